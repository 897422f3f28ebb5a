"""``--quantize`` (as llm-compressor's model_free_ptq) and dequantization on ``--dtype``."""

from streamck.plan.quant.dequant import SCALE_NAMES, dequantize_plan, quantized_kind
from streamck.plan.quant.plan import quantize_plan

__all__ = ["SCALE_NAMES", "dequantize_plan", "quantize_plan", "quantized_kind"]
