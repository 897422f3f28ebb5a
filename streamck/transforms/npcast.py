"""Float casts in numpy with the bits of torch's CPU ``Tensor.to``, into reused buffers.

Each conversion is what torch does, found by experiment (tests/test_npcast.py and
tests/test_cast.py hold torch as the oracle): widening is exact; F64→F32, F32→F16 and
F32→BF16 round to nearest, ties to even, through subnormals; F64→F16 and F64→BF16
round *twice*, through F32 (torch converts a double to a float first), and BF16→F16
and F16→BF16 go through F32 (exact). BF16 has no numpy dtype: it is the top half of an
F32, rounded with integer arithmetic. NaNs come out as torch's vectorised loops write
them (0xFFFF in BF16, but 0x7FC0 from F16; quieted, with the payload's top bits,
elsewhere), where a block's range check or a NaN search finds them; the promise is
only that a NaN stays a NaN.

Work runs in blocks of ``BLOCK`` elements so that a block's input, intermediates and
output stay in the CPU cache; every intermediate lives in preallocated scratch arrays
(2 MiB). numpy releases the GIL inside these loops, so a reader thread can fill the
next input buffer meanwhile. Bytes are viewed in the host's order: little-endian, as
safetensors stores them, on every host streamck runs on.
"""

from __future__ import annotations

import numpy as np

# Elements per kernel pass: 512 KiB of F32, small enough for L2, large enough that the
# ~10 numpy calls per block cost little.
BLOCK = 1 << 17

# Largest finite value of each castable dtype: a block whose |values| stay within the
# target's is cast without looking for overflow or NaN (one min and one max pass).
MAX_FINITE = {
    "F64": float(np.finfo(np.float64).max),
    "F32": float(np.finfo(np.float32).max),
    "BF16": float(np.uint32(0x7F7F0000).view(np.float32)),
    "F16": float(np.finfo(np.float16).max),
}
# The numpy dtype each castable dtype is viewed as (BF16: its bits).
NP_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16}

# A float's quiet-NaN bit, which torch's (hardware) conversions set and numpy's
# (software) half conversions leave clear.
_QUIET = {np.dtype(np.float64): 1 << 51, np.dtype(np.float32): 1 << 22}
_BITS = {np.dtype(np.float64): np.uint64, np.dtype(np.float32): np.uint32, np.dtype(np.float16): np.uint16}


def can_overflow(src: str, dst: str) -> bool:
    """Whether casting ``src`` to ``dst`` can turn a finite value into infinity."""
    return MAX_FINITE[dst] < MAX_FINITE[src]


class Converter:
    """Casts flat arrays between F64/F32/F16/BF16; holds the scratch for one block."""

    def __init__(self, block: int = BLOCK):
        self.block = block
        self._f32 = np.empty(block, np.float32)  # a block's values as F32, where the route passes it
        self._f64 = np.empty(block, np.float64)  # F16 widened on its way to F32
        self._u32 = np.empty(block, np.uint32)  # BF16 rounding

    def convert(self, src: str, dst: str, inp: np.ndarray, out: np.ndarray) -> int:
        """Cast the bytes ``inp`` (``src`` elements) into ``out`` (as many ``dst`` elements).
        ``inp`` may be overwritten. Returns how many finite values became infinite."""
        a, b = inp.view(NP_DTYPES[src]), out.view(NP_DTYPES[dst])
        if len(a) != len(b):
            raise ValueError(f"{len(a)} {src} elements into room for {len(b)} {dst}")
        if src == dst:
            np.copyto(b, a)
            return 0
        inf, n = 0, self.block
        with np.errstate(all="ignore"):  # overflow to inf and NaN compares are expected
            for i in range(0, len(a), n):
                inf += self._block(src, dst, a[i : i + n], b[i : i + n])
        return inf

    def _block(self, src: str, dst: str, a: np.ndarray, b: np.ndarray) -> int:
        # 1. The values as F32 where torch's route passes through F32; else the source.
        if src == "BF16":
            x = b if dst == "F32" else self._f32[: len(a)]
            _bf16_to_f32(a, x)
        elif src == "F16" and dst != "F64":  # numpy widens F16 to F64 twice as fast as to F32
            x = b if dst == "F32" else self._f32[: len(a)]
            wide = self._f64[: len(a)]
            np.copyto(wide, a)
            np.copyto(x, wide, casting="unsafe")  # exact
        elif src == "F64" and dst in ("F16", "BF16"):  # torch rounds to F32 first
            x = self._f32[: len(a)]
            np.copyto(x, a, casting="unsafe")
        else:
            x = a
        # 2. Overflow (and, into BF16, NaN) is possible only where some |value| exceeds
        # the target's largest finite: one min and one max pass rule it out (NaN fails).
        ranged = a if src in ("F64", "F32") else x  # F16 and BF16 widen exactly into x
        slow = False
        if can_overflow(src, dst) or dst == "BF16":
            slow = not max(-float(ranged.min()), float(ranged.max())) <= MAX_FINITE[dst]
        finite = np.isfinite(ranged) if slow else None
        # 3. The final rounding or widening; then NaNs as torch writes them.
        if dst == "BF16":
            nan = np.isnan(x) if slow else None
            _f32_to_bf16(x, b, self._u32[: len(a)])
            if not slow:
                return 0
            np.copyto(b, 0x7FC0 if src == "F16" else 0xFFFF, where=nan)
            became_inf = (b & 0x7FFF) == 0x7F80
        else:
            if x is not b:
                np.copyto(b, x, casting="unsafe")
            if src == "F16" and np.isnan(b.max()):  # no range check ran: look for NaN here
                _quiet(b)
            if not slow:
                return 0
            if dst == "F16" and src != "F64":
                _f32_nan_to_f16(x, b)
            became_inf = np.isinf(b)
        return int(np.count_nonzero(became_inf & finite))


def _bf16_to_f32(a: np.ndarray, x: np.ndarray) -> None:
    """BF16 bits ``a`` into the F32 array ``x``: exact, the bits shifted up."""
    bits = x.view(np.uint32)
    np.copyto(bits, a)
    np.left_shift(bits, 16, out=bits)


def _f32_to_bf16(x: np.ndarray, b: np.ndarray, t: np.ndarray) -> None:
    """F32 ``x`` rounded to nearest even into the BF16 bits ``b`` (``t``: uint32 scratch).

    ``(bits + 0x7FFF + lsb) >> 16``, as torch's kernels compute it; NaNs come out
    arbitrary (the caller replaces them), finite values round to ±inf past the range.
    """
    bits = x.view(np.uint32)
    np.right_shift(bits, 16, out=t)
    np.bitwise_and(t, 1, out=t)
    np.add(t, bits, out=t)
    np.add(t, 0x7FFF, out=t)
    np.right_shift(t, 16, out=t)
    np.copyto(b, t, casting="unsafe")


def _quiet(b: np.ndarray) -> None:
    """Set the quiet bit of every NaN in the F32/F64 array ``b`` (F16 widened), as F16C does."""
    bits = b.view(_BITS[b.dtype])
    np.bitwise_or(bits, bits.dtype.type(_QUIET[b.dtype]), out=bits, where=np.isnan(b))


def _f32_nan_to_f16(x: np.ndarray, b: np.ndarray) -> None:
    """Each NaN of F32 ``x`` into F16 ``b`` as F16C's vcvtps2ph makes it: the sign, the quiet
    bit, the payload's top bits (numpy keeps a signalling NaN signalling)."""
    nan = np.isnan(x)
    if nan.any():
        bits = x.view(np.uint32)[nan]
        b.view(np.uint16)[nan] = (bits >> 16 & 0x8000 | 0x7E00 | bits >> 13 & 0x3FF).astype(np.uint16)


def equal_but_nan_bits(a: memoryview | bytes, b: memoryview | bytes, dtype: str) -> bool:
    """Whether ``a`` and ``b`` (``dtype`` elements) hold the same bits but where both hold a
    NaN (of any bits): two casts of one source, by routes that write NaNs differently."""
    x, y = np.frombuffer(a, NP_DTYPES[dtype]), np.frombuffer(b, NP_DTYPES[dtype])
    if len(x) != len(y):
        return False
    if dtype == "BF16":
        nan = ((x & 0x7FFF) > 0x7F80) & ((y & 0x7FFF) > 0x7F80)
    else:
        nan = np.isnan(x) & np.isnan(y)
    bits = np.dtype(f"u{x.itemsize}")
    return bool(np.all((x.view(bits) == y.view(bits)) | nan))
