"""Block-in, block-out computations of output tensors (quantize, dequantize; see each module)."""
