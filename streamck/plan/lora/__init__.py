"""``--merge-lora``: a PEFT adapter merged into a plan (plan.py), its config read and
checked (config.py); the arithmetic is streamck.transforms.lora's."""
