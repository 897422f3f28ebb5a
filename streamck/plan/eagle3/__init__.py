"""EAGLE-3 drafts (NeMo Automodel) → the layout vLLM and SGLang load, or speculators'
(plan.py); the engines' reading rules as data (layout.py); aux-layer ids (aux.py)."""
