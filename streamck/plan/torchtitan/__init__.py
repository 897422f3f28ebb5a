"""torchtitan steps → Hugging Face (plan.py); its names per model family as data (layout.py)."""
