"""MLX's group quantization (``mx.quantize``: modes ``affine``, ``mxfp4``, ``nvfp4``, ``mxfp8``) in numpy,
a band of rows at a time.

Each group of ``group`` consecutive values of a row gets a scale and a bias, computed in float32
as MLX's CPU kernel computes them (``affine_quantize``): the scale ``max((max - min) / (2^bits - 1),
1e-7)``, signed towards the edge of larger magnitude, then made exact for that edge (``edge /
round(edge / scale)``, the bias ``edge``; a zero edge keeps the scale and a zero bias); each value
is ``clip(round((x - bias) / scale), 0, 2^bits - 1)``, ties to even, packed little end first into
uint32 words (``32 / bits`` values each). Scales and biases are written in the weight's dtype.

``mxfp4``: groups of 32, each with a power-of-two scale ``2^ceil(log2(max|x| / 6))`` (an E8M0
byte, 127 for an all-zero group) and 4-bit E2M1 values ``x / scale``, rounded to the nearest of
0, 0.5, 1, 1.5, 2, 3, 4, 6 with ties toward zero and saturating at 6 (a value rounded to zero
is +0), eight to a uint32 word, little end first; there are no biases. ``nvfp4`` (groups of 16,
E4M3 scales, no global scale) and ``mxfp8`` (groups of 32, E8M0 scales, E4M3 values, four to a
word) follow MLX's ``fp_quantize``, whose steps are ops on the weight's dtype: see nvfp4() and
mxfp8(). Every rule was checked against mlx 0.32.4's CPU ``mx.quantize`` (tests/test_mlx.py's
test_quantize_is_mx_quantize holds it as the oracle).

The weight is first cast to the dtype MLX holds it in (``mlx_lm.convert``'s ``--dtype``, or the
source's), so that the quantization sees the values MLX would. A group depends on its own values
only: a band of rows gives the whole tensor's bytes for those rows, and memory stays near a few
bands (THREADS computed at once while the next is read) whatever the tensor's size (an expert stack
is a band of experts' rows at a time).
"""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from streamck.errors import OutputError
from streamck.source import TensorRef
from streamck.source.reader import Reader, TensorStream
from streamck.transforms.base import Computed, PieceStream, Transform

BAND_VALUES = 1 << 20  # values per band (4 MiB of float32 in, a quarter of that out at 8 bits)
# Bands computed at once, beside the thread reading the next: one per two cores (measured on 2 cores:
# a second computing thread cost more in page faults and contention than it gained), at most 4.
THREADS = max(1, min(4, (os.cpu_count() or 2) // 2))
PARTS = {"affine": ("weight", "scales", "biases"), **{m: ("weight", "scales") for m in ("mxfp4", "nvfp4", "mxfp8")}}
_WIDEN = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}
_E2M1_MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)  # between 0, 0.5, 1 … 4, 6
_STASH = "mlx_quant"  # the writer thread's ``space`` key: the scales and biases computed with a weight


def packed_shape(shape: tuple[int, ...], bits: int) -> tuple[int, ...]:
    """The uint32 shape of a quantized weight of ``shape``: the last axis in words of ``32 / bits`` values."""
    return (*shape[:-1], shape[-1] * bits // 32)


def mxfp4(w: np.ndarray, group: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """``mx.quantize(w, mode="mxfp4")`` of the float32 rows ``w`` [rows, cols]: the packed
    uint32 words and the E8M0 scale bytes."""
    rows, cols = w.shape
    g = w.reshape(rows, cols // group, group)
    top = np.abs(g).max(-1) / np.float32(6.0)
    mantissa, exponent = np.frexp(top)  # top = m * 2^e, m in [0.5, 1): ceil(log2 top) is e, or e - 1 for m = 0.5
    ceil = np.where(mantissa == 0.5, exponent - 1, exponent)
    ceil = np.where(top == 0, 0, np.clip(ceil, -127, 127))
    scales = (ceil + 127).astype(np.uint8)
    x = np.abs(g) / np.exp2(ceil.astype(np.float32))[..., None]
    codes = np.zeros(x.shape, np.uint8)
    for bound in _E2M1_MIDPOINTS:  # the count of midpoints below x is its code: a tie rounds down
        codes += (x > bound).view(np.uint8)
    codes = np.where((codes != 0) & np.signbit(g), codes | np.uint8(8), codes).astype(np.uint8)
    return pack(codes.reshape(rows, cols), 4), scales


def _in_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 ``x`` rounded to ``dtype`` (as an MLX op on an array of that dtype rounds its
    result), as float32 again."""
    return as_float32(np.ascontiguousarray(from_float32(x, dtype)), dtype).reshape(x.shape)


def e4m3(x: np.ndarray) -> np.ndarray:
    """float32 values as E4M3 bytes, as MLX's ``to_fp8`` (``ToFP8``) makes them: rounded to
    nearest, ties to even, subnormals included, saturating at ±448 (0x7E), the sign kept."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    sign = (bits >> 24).astype(np.uint8) & np.uint8(0x80)
    mag = bits & np.uint32(0x7FFFFFFF)
    denorm = np.uint32(141 << 23)  # adding 2^14 leaves a subnormal's code in the low bits
    low = ((mag.view(np.float32) + denorm.view(np.float32)).view(np.uint32) - denorm).astype(np.uint8)
    odd = (mag >> 20) & np.uint32(1)
    high = ((mag + np.uint32(((7 - 127) << 23) % (1 << 32)) + np.uint32(0x7FFFF) + odd) >> 20).astype(np.uint8)
    codes = np.where(mag < np.uint32(121 << 23), low, high)
    return np.where(mag >= np.uint32(543 << 21), np.uint8(0x7E), codes) | sign


def _e4m3_values() -> np.ndarray:
    """The value of each of the 256 E4M3 bytes (MLX's ``from_fp8``), as float32."""
    c = np.arange(256)
    exp, man = (c >> 3) & 0xF, c & 7
    mag = np.where(exp == 0, man / 8 * 2.0**-6, (1 + man / 8) * 2.0 ** (exp - 7))
    return np.where(c & 0x80, -mag, mag).astype(np.float32)


E4M3_VALUES = _e4m3_values()


def _e2m1(x: np.ndarray, g: np.ndarray) -> np.ndarray:
    """Each float32 value of ``x`` (``g``'s, scaled) as its nearest E2M1 code, ties toward zero
    (the first of MLX's table that is nearest), a value rounded to zero or not finite +0."""
    codes = np.zeros(x.shape, np.uint8)
    ax = np.abs(x)
    for bound in _E2M1_MIDPOINTS:  # the count of midpoints below x is its code: a tie rounds down
        codes += (ax > bound).view(np.uint8)
    codes = np.where(np.isfinite(x), codes, np.uint8(0))
    return np.where((codes != 0) & np.signbit(g), codes | np.uint8(8), codes).astype(np.uint8)


def nvfp4(w: np.ndarray, dtype: str, group: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """``mx.quantize(w, mode="nvfp4")`` (no global scale) of the rows ``w`` [rows, cols] (float32
    values of ``dtype``): each group's scale ``max|x| / 6`` rounded to ``dtype`` then to E4M3, each
    value ``x / scale`` rounded to ``dtype`` then to E2M1 (ties toward zero); the packed uint32
    words and the E4M3 scale bytes."""
    rows, cols = w.shape
    g = w.reshape(rows, cols // group, group)
    scales = e4m3(_in_dtype(np.abs(g).max(-1) / np.float32(6.0), dtype))
    with np.errstate(divide="ignore", invalid="ignore"):  # a zero scale: its values are +0, as MLX's
        x = _in_dtype(g / E4M3_VALUES[scales][..., None], dtype)
    return pack(_e2m1(x, g).reshape(rows, cols), 4), scales


def mxfp8(w: np.ndarray, dtype: str, group: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """``mx.quantize(w, mode="mxfp8")`` of the rows ``w`` [rows, cols] (float32 values of
    ``dtype``): each group's power-of-two scale ``2^ceil(log2(max|x| / 448))``, the quotient
    rounded to ``dtype`` first (an E8M0 byte, 127 for an all-zero group), each value ``x / scale``
    as E4M3 (to nearest, ties to even, saturating at 448); the words (four bytes each) and the
    scale bytes."""
    rows, cols = w.shape
    g = w.reshape(rows, cols // group, group)
    top = _in_dtype(np.abs(g).max(-1) / np.float32(448.0), dtype)
    mantissa, exponent = np.frexp(top)  # as in mxfp4: ceil(log2 top) is e, or e - 1 for m = 0.5
    ceil = np.where(mantissa == 0.5, exponent - 1, exponent)
    ceil = np.where(top == 0, 0, np.clip(ceil, -127, 127))
    x = g / np.exp2(ceil.astype(np.float32))[..., None]
    return pack(e4m3(x).reshape(rows, cols), 8), (ceil + 127).astype(np.uint8)


def group_shape(shape: tuple[int, ...], group: int) -> tuple[int, ...]:
    """The shape of the scales (and biases) of a weight of ``shape``: one per ``group`` values."""
    return (*shape[:-1], shape[-1] // group)


def as_float32(raw: bytes | memoryview | np.ndarray, dtype: str) -> np.ndarray:
    """``raw`` values of ``dtype`` (F32, F16, BF16) as float32, exactly."""
    values = np.frombuffer(raw, dtype=_WIDEN[dtype])
    if dtype == "BF16":
        return (values.astype(np.uint32) << 16).view(np.float32)
    return values.astype(np.float32)


def from_float32(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values in ``dtype`` (its bits: uint16 for BF16), rounded to nearest, ties to even,
    as MLX's ``astype`` rounds (a NaN becomes BF16's 0x7FC0)."""
    if dtype == "F32":
        return x
    if dtype == "F16":
        return x.astype(np.float16)
    u = x.view(np.uint32)
    out = ((u + np.uint32(0x7FFF) + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), out)


def affine(w: np.ndarray, group: int, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``mx.quantize(w, group, bits)`` of the float32 rows ``w`` [rows, cols]: the packed uint32
    words and the float32 scales and biases (before their cast to the weight's dtype)."""
    rows, cols = w.shape
    g = w.reshape(rows, cols // group, group)
    w_max, w_min = g.max(-1), g.min(-1)
    n_bins = np.float32((1 << bits) - 1)
    mask = np.abs(w_min) > np.abs(w_max)
    scale = np.maximum((w_max - w_min) / n_bins, np.float32(1e-7))
    scale = np.where(mask, scale, -scale)
    edge = np.where(mask, w_min, w_max)
    q0 = np.rint(edge / scale)
    exact = q0 != 0
    scale = np.where(exact, edge / np.where(exact, q0, 1), scale).astype(np.float32)
    bias = np.where(exact, edge, np.float32(0)).astype(np.float32)
    q = g - bias[..., None]  # in place from here: a band's float32 values are the largest buffer
    np.divide(q, scale[..., None], out=q)
    np.rint(q, out=q)
    np.clip(q, 0, n_bins, out=q)
    return pack(q.astype(np.uint8).reshape(rows, cols), bits), scale, bias


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Rows of ``bits``-bit codes (uint8) as uint32 words, the first code in the lowest bits."""
    rows, cols = codes.shape
    if bits == 8:
        return codes.view(np.uint32)
    if bits == 4:  # a pair of codes as one little-endian uint16 c0 | c1 << 8; its low byte folded is c0 | c1 << 4
        pairs = np.ascontiguousarray(codes).view(np.uint16)
        return (pairs | (pairs >> np.uint16(4))).astype(np.uint8).view(np.uint32)
    per = 32 // bits
    shifts = np.arange(per, dtype=np.uint32) * np.uint32(bits)
    words = codes.astype(np.uint32).reshape(rows, cols // per, per) << shifts
    return np.bitwise_or.reduce(words, axis=-1).astype(np.uint32)


@dataclass(frozen=True, slots=True)
class MlxQuant:
    """One of a quantized weight's tensors (``part``: ``weight``, ``scales``, or for ``affine``
    ``biases``) computed from the output's source, whose logical shape is ``shape``: the source
    read a band of rows at a time, cast to ``dtype`` (the dtype MLX holds the weight in),
    quantized in ``mode`` in groups of ``group`` values to ``bits`` bits. Computing the weight
    keeps its scales and biases (a sixteenth of its bytes or less) in the writer thread's space,
    so that the tensors after it need no second pass over the source. With ``inner`` (a quantized
    source's dequantization, streamck.transforms.dequantize), what is quantized is that transform's
    output, in ``computes`` (its dtype), read band by band as it computes it: never held whole."""

    part: str
    shape: tuple[int, ...]
    dtype: str
    group: int
    bits: int
    mode: str = "affine"
    engine: str = "numpy"
    exact: bool = True
    inner: Transform | None = None
    computes: str = ""

    @property
    def label(self) -> str:
        read = f"{self.inner.label}, " if self.inner is not None and self.inner.label else ""
        return f"{read}MLX {self.mode} {self.bits}-bit {self.part}"

    def inputs(self) -> tuple[TensorRef, ...]:
        return () if self.inner is None else self.inner.inputs()

    def origin(self, source: TensorRef) -> TensorRef:
        return source if self.inner is None else self.inner.origin(source)

    def pieces(self, target, reader: Reader, space: dict) -> Iterator[memoryview]:
        """The part's bytes, a band of whole rows at a time."""
        # The inner transform is in the key: gpt-oss's gate and up are two halves of one source tensor.
        key = (target.source, self.dtype, self.group, self.bits, self.mode, self.inner)
        stash = space.get(_STASH)
        if self.part != "weight" and stash is not None and stash[0] == key:
            yield from (memoryview(b) for b in stash[1][self.part])
            return
        kept: dict[str, list[bytes]] = {p: [] for p in PARTS[self.mode][1:]}
        for band in self._bands(*self._input(target, reader, space)):
            if self.part == "weight":
                for p in kept:
                    kept[p].append(band[p].tobytes())
            yield memoryview(np.ascontiguousarray(band[self.part])).cast("B")
        space[_STASH] = (key, kept) if self.part == "weight" else None

    def _input(self, target, reader: Reader, space: dict) -> tuple[TensorRef, TensorStream | PieceStream]:
        """What is quantized, as a ref (its dtype and logical shape) and a stream of its bytes:
        the source's, or the inner transform's output as it computes it."""
        ref = target.source
        if self.inner is None:
            return ref, reader.stream(ref)
        pieces = self.inner.pieces(Computed(target.name, ref, self.computes), reader, space)
        return ref._replace(dtype=self.computes, shape=self.shape), PieceStream(pieces)

    def _bands(self, ref: TensorRef, stream: TensorStream | PieceStream) -> Iterator[dict[str, np.ndarray]]:
        """Each band's outputs in order; THREADS bands computed at once while the next is read
        (numpy lets go of the GIL in its loops), so memory holds THREADS + 1 bands."""
        with ThreadPoolExecutor(THREADS) as pool:
            pending: deque = deque()
            for raw in self._reads(ref, stream):
                pending.append(pool.submit(self._quantize, raw, ref.dtype))
                if len(pending) >= THREADS:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()

    def _reads(self, ref: TensorRef, stream: TensorStream | PieceStream) -> Iterator[bytearray]:
        cols = self.shape[-1]
        rows = math.prod(self.shape[:-1])
        item = np.dtype(_WIDEN[ref.dtype]).itemsize
        step = max(1, BAND_VALUES // max(cols, 1))
        for start in range(0, rows, step):
            n = min(step, rows - start)
            buf = bytearray(n * cols * item)
            if stream.readinto(memoryview(buf)) != len(buf):
                raise OutputError(f"{ref.name}: its source ended before row {start + n}", ref.path)
            yield buf

    def _quantize(self, raw: bytearray, dtype: str) -> dict[str, np.ndarray]:
        w = as_float32(raw, dtype)
        if self.dtype != dtype:  # MLX casts the weight before it quantizes it
            w = as_float32(from_float32(w, self.dtype), self.dtype)
        w = w.reshape(-1, self.shape[-1])
        if self.mode != "affine":
            packed, scales = mxfp4(w, self.group) if self.mode == "mxfp4" else FP_MODES[self.mode](w, self.dtype)
            return {"weight": packed, "scales": scales}
        packed, scales, biases = affine(w, self.group, self.bits)
        return {
            "weight": packed,
            "scales": from_float32(scales, self.dtype),
            "biases": from_float32(biases, self.dtype),
        }


@dataclass(frozen=True, slots=True)
class MlxStack:
    """An expert stack [E, …] (mlx-lm's ``switch_mlp``) of a quantized source's experts: each
    expert's ``(source, transform)`` (its dequantization, streamck.transforms.dequantize) computed
    in ``dtype``, one expert after another, so that a band of one expert is what is held."""

    experts: tuple[tuple[TensorRef, Transform], ...]
    dtype: str
    engine: str = "torch"
    exact: bool = True

    @property
    def label(self) -> str:
        return f"{self.experts[0][1].label}, {len(self.experts)} experts stacked"

    def inputs(self) -> tuple[TensorRef, ...]:
        refs = [r for source, transform in self.experts for r in (source, *transform.inputs())]
        return tuple(dict.fromkeys(refs))

    def origin(self, source: TensorRef) -> TensorRef:
        return source

    def pieces(self, target, reader: Reader, space: dict) -> Iterator[memoryview]:
        """Each expert's bytes in turn, as its own transform computes them."""
        for source, transform in self.experts:
            yield from transform.pieces(Computed(target.name, source, self.dtype), reader, space)


FP_MODES = {"nvfp4": nvfp4, "mxfp8": mxfp8}  # the modes whose rounding sees the weight's dtype
