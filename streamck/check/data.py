"""Tensor contents compared chunk by chunk with numpy: how many elements differ, and by how much."""

from __future__ import annotations

import numpy as np

from streamck.source import TensorRef
from streamck.source.reader import Reader

# dtype -> (numpy dtype of the raw element, how to read it as float64 or None)
_RAW = {
    "F64": ("<u8", "<f8"),
    "F32": ("<u4", "<f4"),
    "F16": ("<u2", "<f2"),
    "BF16": ("<u2", "bf16"),
    "I64": ("<u8", "<i8"),
    "I32": ("<u4", "<i4"),
    "I16": ("<u2", "<i2"),
    "I8": ("u1", "i1"),
    "U64": ("<u8", "<u8"),
    "U32": ("<u4", "<u4"),
    "U16": ("<u2", "<u2"),
    "U8": ("u1", "u1"),
    "BOOL": ("u1", "u1"),
}
_STEP = 8 << 20  # a multiple of every item size


def _values(raw: np.ndarray, how: str) -> np.ndarray:
    if how == "bf16":
        return (raw.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return raw.view(how).astype(np.float64)


def compare_tensor(a: TensorRef, b: TensorRef) -> tuple[int, int, float | None] | None:
    """None when the bytes are equal; otherwise (differing elements, elements, largest
    absolute difference among them or None where the dtype is not numeric to numpy).
    Dtypes numpy cannot read (F8, F4, ...) are compared, and counted, byte by byte."""
    raw_dtype, how = _RAW.get(a.dtype, ("u1", None))
    differing, max_abs = 0, 0.0
    # Both sides in windows of the same size, whatever their runs: a view's gathered
    # blocks and a contiguous copy's chunks end in different places.
    with Reader(_STEP) as ra, Reader(_STEP) as rb:
        for pa, pb in zip(ra.windows(a), rb.windows(b), strict=True):
            if pa == pb:
                continue
            xa, xb = np.frombuffer(pa, raw_dtype), np.frombuffer(pb, raw_dtype)
            diff = xa != xb
            differing += int(diff.sum())
            if how is not None:
                with np.errstate(invalid="ignore", over="ignore"):
                    delta = np.abs(_values(xa[diff], how) - _values(xb[diff], how))
                finite = delta[~np.isnan(delta)]
                if finite.size:
                    max_abs = max(max_abs, float(finite.max()))
    if not differing:
        return None
    numel = a.numel if how is not None else a.nbytes
    return differing, numel, max_abs if how is not None else None
