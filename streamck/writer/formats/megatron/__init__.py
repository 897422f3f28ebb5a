"""Megatron-LM ``torch_dist`` output (streamck.writer.formats.megatron.format)."""
