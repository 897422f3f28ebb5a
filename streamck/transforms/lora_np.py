"""A LoRA merge without torch: the same blocks and operations as streamck.transforms.lora_torch, in numpy.

Not PEFT's bits: numpy's GEMM (OpenBLAS) sums the r products in another order than torch's
for many shapes, and numpy's norm (DoRA) sums a row in another order; the fp32 results
differ in the last bits, and rounded to W's dtype a few values differ (none on the tests' small
bases and at r = 64; at r = 256, 0.01% of them, by up to 4 units in the last place:
tests/test_lora_numpy.py). Chosen when torch is not
installed (said in the plan's summary), or asked for (``--merge-engine numpy``): no torch
import, so a few tens of MiB of memory and no second of start-up.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from streamck.errors import OutputError
from streamck.source.header import TensorRef
from streamck.source.reader import Reader
from streamck.transforms.base import Target
from streamck.transforms.lora import LoraMerge, copy_blocks, merge_blocks
from streamck.transforms.npcast import NP_DTYPES, Converter


@dataclass(frozen=True, slots=True)
class NumpyMerge(LoraMerge):
    """A LoRA merge computed with numpy: no torch, not PEFT's bits (see above)."""

    engine = "numpy"
    exact = False

    def pieces(self, target: Target, reader: Reader, space: dict) -> Iterator[memoryview]:
        return _merged(self, target, reader, Converter())


def _f32(conv: Converter, data: np.ndarray, dtype: str) -> np.ndarray:
    """The bytes ``data`` of ``dtype`` elements as a new fp32 array."""
    out = np.empty(len(data) // np.dtype(NP_DTYPES[dtype]).itemsize, np.float32)
    conv.convert(dtype, "F32", data.copy(), out.view(np.uint8))
    return out


def _whole(reader: Reader, conv: Converter, ref: TensorRef) -> np.ndarray:
    buf = np.empty(ref.nbytes, np.uint8)
    if reader.stream(ref).readinto(memoryview(buf)) != ref.nbytes:
        raise OutputError(f"{ref.name} ended early", ref.path)
    return _f32(conv, buf, ref.dtype).reshape(ref.shape)


def _rounded(conv: Converter, x: np.ndarray, dtype: str) -> np.ndarray:
    """fp32 ``x`` rounded to ``dtype`` and back (PEFT's ``delta.to(W.dtype)`` before the add)."""
    out = np.empty(x.size * np.dtype(NP_DTYPES[dtype]).itemsize, np.uint8)
    conv.convert("F32", dtype, np.ascontiguousarray(x).reshape(-1).view(np.uint8), out)
    return _f32(conv, out, dtype).reshape(x.shape)


def _merged(m: LoraMerge, t: Target, reader: Reader, conv: Converter) -> Iterator[memoryview]:
    """As streamck.transforms.lora_torch's, in buffers made once per tensor."""
    w = t.source
    scale = np.float32(m.scale)
    if m.kind == "bias":
        total = _whole(reader, conv, w) + _whole(reader, conv, m.b) * scale
        yield from _emit(m, t, conv, total.reshape(-1), np.empty(w.nbytes, np.uint8))
        return
    if m.kind == "copy":
        yield from _copied(m, t, reader, conv)
        return
    rows, cols = w.shape
    a, b = _whole(reader, conv, m.a), _whole(reader, conv, m.b)
    magnitude = _whole(reader, conv, m.magnitude) if m.magnitude is not None else None
    size = w.nbytes // max(w.numel, 1)
    blocks = merge_blocks(rows, cols)
    most = max(e - s for s, e in blocks) * cols
    raw, out = np.empty(most * size, np.uint8), np.empty(most * size, np.uint8)
    total, delta = np.empty(most, np.float32), np.empty(most, np.float32)
    stream = reader.stream(w)
    for start, end in blocks:
        n = end - start
        if stream.readinto(memoryview(raw[: n * cols * size])) != n * cols * size:
            raise OutputError(f"{w.name} ended early", w.path)
        conv.convert(w.dtype, "F32", raw[: n * cols * size], total[: n * cols].view(np.uint8))
        block = total[: n * cols].reshape(n, cols)
        if m.transposed:  # (B @ A[:, rows])^T * s
            d = np.matmul(b, a[:, start:end], out=delta[: n * cols].reshape(cols, n))
            d = np.multiply(d, scale, out=d).T
        else:  # (B[rows] @ A) * s
            d = np.matmul(b[start:end], a, out=delta[: n * cols].reshape(n, cols))
            np.multiply(d, scale, out=d)
        np.add(block, _rounded(conv, d, w.dtype) if m.round_delta else d, out=block)
        if magnitude is not None:  # DoRA: each row to magnitude / its norm
            block *= (magnitude[start:end] / np.linalg.norm(block, axis=1))[:, None]
        yield from _emit(m, t, conv, total[: n * cols], out[: n * cols * size])


def _copied(m: LoraMerge, t: Target, reader: Reader, conv: Converter) -> Iterator[memoryview]:
    """As streamck.transforms.lora_torch's: a saved copy rounded to W's dtype, then cast, block by block."""
    copy, stream = m.b, reader.stream(m.b)
    for count, nbytes in copy_blocks(copy):
        raw = np.empty(nbytes, np.uint8)
        if stream.readinto(memoryview(raw)) != nbytes:
            raise OutputError(f"{copy.name} ended early", copy.path)
        yield from _emit(
            m,
            t,
            conv,
            _f32(conv, raw, copy.dtype),
            np.empty(count * (t.source.nbytes // max(t.source.numel, 1)), np.uint8),
        )


def _emit(m: LoraMerge, t: Target, conv: Converter, total: np.ndarray, out: np.ndarray) -> Iterator[memoryview]:
    """``total`` (flat fp32, overwritten) rounded into ``out`` in W's dtype, then cast to
    ``t.dtype`` when asked, as bytes. safe_merge refuses a value that is not finite in W's dtype."""
    finite = not m.safe or np.isfinite(total).all()
    became_inf = conv.convert("F32", t.source.dtype, total.view(np.uint8), out)
    if not finite or (m.safe and became_inf):
        raise OutputError(f"NaNs or infinities in the merged {t.name}: the adapter seems broken (safe_merge)")
    if t.dtype != t.source.dtype:
        cast = np.empty(total.size * np.dtype(NP_DTYPES[t.dtype]).itemsize, np.uint8)
        conv.convert(t.source.dtype, t.dtype, out, cast)
        out = cast
    yield memoryview(out)
