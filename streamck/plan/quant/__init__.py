"""``--quantize`` (as llm-compressor's model_free_ptq: plan.py, layout.py) and dequantization on
``--dtype`` (dequant.py)."""
