"""GGML's Q8_0 blocks from a float tensor, as llama.cpp's ``convert_hf_to_gguf.py`` writes them.

A Q8_0 block is 32 consecutive values of a row: a float16 scale ``d = max|x| / 127`` and 32 int8
``round(x / d)`` (halves away from zero), 34 bytes. The reference widens the source to float32
and quantizes with gguf-py's ``quants.quantize`` (``Q8_0.quantize_blocks``); quantize_blocks here
computes the same bytes in fewer passes over the data (see there why each step is exact), in
cache-sized chunks, a band's blocks split between two threads (numpy releases the GIL in its
loops). Each block depends on its own 32 values only, so a band's bytes are the whole tensor's
bytes for those rows, and memory stays near one band (Q8_VALUES values read, widened chunk by
chunk, and their blocks) whatever the tensor's size.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from streamck.errors import OutputError
from streamck.source.reader import Reader
from streamck.transforms.base import OwnSource

BLOCK, BLOCK_BYTES = 32, 34  # values per block, bytes per block (f16 scale + 32 int8)
Q8_VALUES = 1 << 20  # a band: this many values (read in their dtype, ~1.06 bytes each out)
CHUNK_BLOCKS = 2048  # blocks a thread quantizes at once: its scratch (4 x 256 KiB) stays in cache
THREADS = min(2, os.cpu_count() or 1)
_WIDEN = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}
# The largest float32 below 0.5: floor(a + HALF) is a rounded half away from zero for every
# float32 0 <= a < 2**22 (a + 0.5 would round 0.49999997 up to 1).
HALF = np.nextafter(np.float32(0.5), np.float32(0))
_TINY = np.finfo(np.float32).tiny
_SIGN, _HALF_BITS = np.uint32(0x80000000), HALF.view(np.uint32)


def q8_0_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The byte shape of ``shape`` quantized to Q8_0: the last axis in 34-byte blocks of 32."""
    return (*shape[:-1], shape[-1] // BLOCK * BLOCK_BYTES)


def widen(raw: bytes | memoryview | np.ndarray, dtype: str, out: np.ndarray | None = None) -> np.ndarray:
    """``raw`` values of ``dtype`` as float32, exactly (bfloat16 is float32's upper half), into
    ``out`` where given (float32, as many values)."""
    values = raw if isinstance(raw, np.ndarray) else np.frombuffer(raw, dtype=_WIDEN[dtype])
    if out is None:
        out = np.empty(values.shape, np.float32)
    if dtype == "BF16":
        np.left_shift(values, 16, out=out.view(np.uint32), dtype=np.uint32)
    else:
        np.copyto(out, values, casting="unsafe")  # F64: the C cast, as numpy's astype(float32)
    return out


def quantize_blocks(x: np.ndarray, out: np.ndarray, scratch: tuple[np.ndarray, ...] = ()) -> None:
    """gguf-py's ``Q8_0.quantize_blocks(x)`` into ``out``: ``x`` is (n, 32) float32, ``out`` (n, 34)
    uint8; ``scratch`` is _scratch(n)'s arrays, reused. Byte for byte the same, in fewer passes:
    gguf-py's ``np_roundf(x * id)`` rounds half away from zero, which for ``|x * id| <= ~127``
    (a normal scale) is ``trunc(x * id + copysign(HALF, x))``: float addition is symmetric in
    sign, and ``floor(a + HALF)`` rounds half away for every float32 ``0 <= a < 2**22``. A
    float ``-0.0`` casts to 0, as gguf-py's ``sign(0) * 0`` does. Blocks with a non-finite value
    or a subnormal scale (where gguf-py's int8 cast is of nan, inf or values past 127) are
    gguf-py's own ``quantize_blocks``'s output."""
    n = len(x)
    a, column, half = scratch or _scratch(n)
    a, column, half = a[:n], column[:, :n], half[:n]
    np.abs(x.T, out=column)  # a block down a column: the max runs along rows, numpy's fast axis
    amax = column.max(axis=0)[:, None]
    d = amax / 127  # gguf-py's expressions for the scale and its inverse, on (n, 1) arrays
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):  # the odd blocks: redone below
        inv = np.where(d == 0, 0, 1 / d)
        np.multiply(x, inv, out=a)
        np.bitwise_and(x.view(np.uint32), _SIGN, out=half)
        half |= _HALF_BITS  # copysign(HALF, x)
        a += half.view(np.float32)
        np.trunc(a, out=a)
        np.copyto(out[:, 2:].view(np.int8), a, casting="unsafe")
        out.view(np.uint16)[:, 0] = d[:, 0].astype(np.float16).view(np.uint16)  # rows of 34 bytes: aligned
    odd = ~(np.isfinite(amax[:, 0]) & ((d[:, 0] >= _TINY) | (d[:, 0] == 0)))
    if odd.any():
        from gguf.quants import Q8_0 as Reference

        with np.errstate(invalid="ignore", over="ignore"):
            out[odd] = Reference.quantize_blocks(x[odd])


def _scratch(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """quantize_blocks's working arrays for up to ``n`` blocks: x * id, |x| transposed, ±HALF."""
    return np.empty((n, BLOCK), np.float32), np.empty((BLOCK, n), np.float32), np.empty((n, BLOCK), np.uint32)


def _quantize_range(raw: np.ndarray, dtype: str, out: np.ndarray, start: int, stop: int) -> None:
    """Blocks ``start:stop`` of ``raw`` (the source's values, (n, 32)) into ``out``, a chunk at a time."""
    x, scratch = np.empty((CHUNK_BLOCKS, BLOCK), np.float32), _scratch(CHUNK_BLOCKS)
    for lo in range(start, stop, CHUNK_BLOCKS):
        hi = min(lo + CHUNK_BLOCKS, stop)
        src = raw[lo:hi]
        block = src if src.dtype == np.float32 else widen(src, dtype, x[: hi - lo])
        quantize_blocks(block, out[lo:hi], scratch)


def quantize(raw: np.ndarray, dtype: str, pool: ThreadPoolExecutor | None = None) -> np.ndarray:
    """The Q8_0 blocks of ``raw`` (values of ``dtype``, a multiple of 32 of them) as (n, 34)
    uint8: gguf-py's ``quantize`` of them widened to float32; with ``pool``, its threads each
    quantize a share of the blocks."""
    blocks = raw.reshape(-1, BLOCK)
    out = np.empty((len(blocks), BLOCK_BYTES), np.uint8)
    n = len(blocks)
    if pool is None or n < 2 * CHUNK_BLOCKS:
        _quantize_range(blocks, dtype, out, 0, n)
        return out
    cut = [n * i // THREADS for i in range(THREADS + 1)]
    jobs = [pool.submit(_quantize_range, blocks, dtype, out, lo, hi) for lo, hi in pairwise(cut)]
    for job in jobs:
        job.result()
    return out


@dataclass(frozen=True, slots=True)
class Q8_0(OwnSource):
    """The output's source quantized to Q8_0 (the output is its bytes: dtype U8, shape
    ``q8_0_shape(shape)``). ``shape`` is the logical shape, which GGUF records with the
    type ``ggml_type``."""

    shape: tuple[int, ...]
    ggml_type: str = "Q8_0"
    label: str = "Q8_0"
    engine: str = "numpy"
    exact: bool = True

    def pieces(self, target, reader: Reader, space: dict) -> Iterator[memoryview]:
        """The Q8_0 bytes, a band of whole rows at a time."""
        ref = target.source
        cols = self.shape[-1]
        rows = math.prod(self.shape[:-1])
        kind = np.dtype(_WIDEN[ref.dtype])
        step = max(1, Q8_VALUES // max(cols, 1))
        stream = reader.stream(ref)
        with ThreadPoolExecutor(THREADS, thread_name_prefix="streamck-q8_0") as pool:
            for start in range(0, rows, step):
                n = min(step, rows - start)
                buf = bytearray(n * cols * kind.itemsize)
                if stream.readinto(memoryview(buf)) != len(buf):
                    raise OutputError(f"{ref.name}: its source ended before row {start + n}", ref.path)
                yield memoryview(quantize(np.frombuffer(buf, kind), ref.dtype, pool)).cast("B")
