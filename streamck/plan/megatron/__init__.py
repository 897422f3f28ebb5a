"""megatron-core ``torch_dist`` → Hugging Face (plan.py); its stacked key layout as data
(layout.py); the run's pickled ``args`` read as inert data (args.py)."""
