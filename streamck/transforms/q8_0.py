"""GGML's Q8_0 blocks from a float tensor, as llama.cpp's ``convert_hf_to_gguf.py`` writes them.

A Q8_0 block is 32 consecutive values of a row: a float16 scale ``d = max|x| / 127`` and 32 int8
``round(x / d)`` (halves away from zero), 34 bytes. The reference widens the source to float32
and quantizes with gguf-py's ``quants.quantize`` (``Q8_0.quantize_blocks``); this transform calls
that very function on one band of rows at a time. Each block depends on its own 32 values
only, so a band's bytes are the whole tensor's bytes for those rows, and memory stays near one
band (Q8_VALUES float32 values and their int8 blocks) whatever the tensor's size.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from streamck.errors import OutputError
from streamck.source import TensorRef
from streamck.source.reader import Reader

BLOCK, BLOCK_BYTES = 32, 34  # values per block, bytes per block (f16 scale + 32 int8)
Q8_VALUES = 1 << 20  # a band: this many values (float32 in, ~1.06 bytes each out)
_WIDEN = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}


def q8_0_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The byte shape of ``shape`` quantized to Q8_0: the last axis in 34-byte blocks of 32."""
    return (*shape[:-1], shape[-1] // BLOCK * BLOCK_BYTES)


def widen(raw: bytes | memoryview, dtype: str) -> np.ndarray:
    """``raw`` values of ``dtype`` as float32, exactly (bfloat16 is float32's upper half)."""
    values = np.frombuffer(raw, dtype=_WIDEN[dtype])
    if dtype == "BF16":
        return (values.astype(np.uint32) << 16).view(np.float32)
    return values.astype(np.float32)


@dataclass(frozen=True, slots=True)
class Q8_0:
    """The output's source quantized to Q8_0 (the output is its bytes: dtype U8, shape
    ``q8_0_shape(shape)``). ``shape`` is the logical shape, which GGUF records with the
    type ``ggml_type``."""

    shape: tuple[int, ...]
    ggml_type: str = "Q8_0"
    label: str = "Q8_0"
    engine: str = "numpy"
    exact: bool = True

    def inputs(self) -> tuple[TensorRef, ...]:
        return ()

    def origin(self, source: TensorRef) -> TensorRef:
        return source

    def pieces(self, target, reader: Reader, space: dict) -> Iterator[memoryview]:
        """The Q8_0 bytes, a band of whole rows at a time."""
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize

        ref = target.source
        cols = self.shape[-1]
        rows = math.prod(self.shape[:-1])
        item = np.dtype(_WIDEN[ref.dtype]).itemsize
        step = max(1, Q8_VALUES // max(cols, 1))
        stream = reader.stream(ref)
        for start in range(0, rows, step):
            n = min(step, rows - start)
            buf = bytearray(n * cols * item)
            if stream.readinto(memoryview(buf)) != len(buf):
                raise OutputError(f"{ref.name}: its source ended before row {start + n}", ref.path)
            band = widen(buf, ref.dtype).reshape(n, cols)
            yield memoryview(quantize(band, GGMLQuantizationType.Q8_0)).cast("B")
