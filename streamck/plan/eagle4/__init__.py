"""EAGLE-4 drafts → ``LlamaForCausalLMEagle4`` (plan.py); the contract as data (layout.py)."""
