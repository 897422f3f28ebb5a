"""Transforms: block-in, block-out computations of output bytes (casts, LoRA merges), each
with its engines (numpy; torch; CUDA for casts). They read through streamck.source and are
used by streamck.writer, which only writes; they import neither the writer nor the plans."""

from streamck.transforms.base import Target, Transform

__all__ = ["Target", "Transform"]
