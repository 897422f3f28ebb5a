"""FP4 (E2M1) weights packed two per byte, with their scales, computed as llm-compressor 0.14.0.1's
``model_free_ptq`` computes them (compressed-tensors 0.19: the min-max observer, ``generate_gparam``,
``calculate_qparams``, ``quantize``, ``pack_fp4_to_uint8`` and the MX scale compressor), band by band.

The arithmetic is the oracle's own torch operations on the same dtypes (``d``: the weight's dtype,
the one it is quantized from), each elementwise or an exact max, on groups of ``group`` columns
that a band of whole rows never cuts, so a band gives the bits the whole tensor gives.

- ``nv`` (NVFP4A16, 16 columns a group): a global scale ``f32(d(2688 / absmax))`` over the
  tensor, or over the tensors vLLM fuses (q/k/v, dense gate/up: ``group``), an all-zero one
  giving 1.0; group scales ``e4m3(gs * d(absmax / 6))`` (a zero becomes 0.125); values
  ``fp4(clamp(w / (scale / gs)))`` in float32.
- ``mx`` (MXFP4A16, 32 columns a group): the group's absmax rounded to a power of two by adding
  a quarter of the mantissa's range and masking it off, the E8M0 exponent
  ``uint8(round(127 + floor(log2(p)) - 2))``; values ``fp4(clamp(w / 2^(e-127)))`` in ``d``.

On a CUDA device (``--device``) each band is computed there with the same operations, every
constant made on the band's device, and copied back.

FP4 rounding (the oracle's CPU ``cast_to_fp4`` then ``pack_fp4_to_uint8``): |x| ≤ 0.25 → 0,
< 0.75 → 0.5, ≤ 1.25 → 1, < 1.75 → 1.5, ≤ 2.5 → 2, < 3.5 → 3, ≤ 5 → 4, else 6 (ties to even),
times ``sign(x)``; a negative value that rounds to zero is -0, nibble 0x8; -0 itself is 0. Nibbles:
even column low, odd column high. Every threshold has at most two mantissa bits, so the f32 bits
above bit 21 (sign, exponent, two mantissa bits) and whether any bit below is set decide the
nibble: one lookup in a 4096-entry table (E2M1), built at import from E2M1_STEPS
(tests/test_fp4_table.py checks it against compressed-tensors). A NaN's nibble (0 or 8) hangs on
the signs torch gives NaNs on the way: a band with one takes compressed-tensors' own operations.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass

from streamck.source import TensorRef
from streamck.source.reader import Reader
from streamck.transforms.base import Computed, PieceStream, Transform, device_of
from streamck.transforms.quantize import _bands, host_bytes

GROUP = {"nv": 16, "mx": 32}
SCHEME_OF = {"nv": "NVFP4A16", "mx": "MXFP4A16"}
FP4_MAX, FP8_MAX = 6.0, 448.0
# Source bytes a band: FP4's float32 temporaries are a dozen times a band, in each writer thread.
FP4_BAND = 1 << 20


# E2M1's rounding steps, as compressed-tensors' cast_to_fp4 takes them: (threshold, whether a value
# equal to it rounds up); a magnitude's index is the number of steps it passes (0 → 0.0 … 7 → 6.0).
E2M1_STEPS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
CUT = 21  # the f32 bits below this one never change the nibble but for being all zero (see the docstring)


NAN = 0x10  # no nibble: a NaN's nibble hangs on the signs torch gives NaNs on the way (see _fp4_reference)


def e2m1_nibble(bits: int) -> int:
    """The nibble compressed-tensors packs for the float32 with these bits (index | 8 if negative);
    NAN for a NaN."""
    x = struct.unpack("<f", struct.pack("<I", bits))[0]
    if x != x:
        return NAN
    index = sum(abs(x) > t or (up and abs(x) == t) for t, up in E2M1_STEPS)
    return index | (8 if x < 0 else 0)


# nibble by key: each the nibble of the key's least member (the bits above CUT, then 0 or 1 below)
E2M1 = bytes(e2m1_nibble(key >> 1 << CUT | key & 1) for key in range(1 << (32 - CUT + 1)))


@dataclass(frozen=True, slots=True)
class Member:
    """One tensor of a global scale's group: its output name, source, and the transform whose
    output is quantized (a LoRA merge), or None."""

    name: str
    source: TensorRef
    inner: Transform | None = None


@dataclass(frozen=True, slots=True)
class Fp4:
    """One output of an FP4-quantized weight: ``part`` "packed", "scale" or "global" (NVFP4's
    global scale), by ``kind`` "nv" or "mx"; ``compute`` the dtype it is quantized from; ``group``
    the tensors sharing the global scale (this one among them)."""

    part: str
    kind: str
    compute: str
    group: tuple[Member, ...] = ()
    inner: Transform | None = None
    engine: str = "torch"
    exact: bool = True

    @property
    def label(self) -> str:
        merged = f"{self.inner.label} " if self.inner is not None and self.inner.label else ""
        shared = f" (shared by {len(self.group)})" if self.part == "global" and len(self.group) > 1 else ""
        return f"{merged}{SCHEME_OF[self.kind]} {self.part}{shared}"

    def inputs(self) -> tuple[TensorRef, ...]:
        refs = [m.source for m in self.group]
        for t in (self.inner, *(m.inner for m in self.group)):
            refs += t.inputs() if t is not None else ()
        return tuple(dict.fromkeys(refs))

    def origin(self, source: TensorRef) -> TensorRef:
        return source if self.inner is None else self.inner.origin(source)

    def pieces(self, target, reader: Reader, space: dict) -> Iterator[memoryview]:
        """The part's bytes, one band of rows at a time (see the module's docstring)."""

        gs = global_scale(self.group, self.compute, reader, space) if self.kind == "nv" else None
        if self.part == "global":
            yield host_bytes(gs)
            return
        for block in _member_bands(Member(target.name, target.source, self.inner), self.compute, reader, space):
            if self.kind == "nv":
                scale = nv_scales(block, gs)
                out = nv_scales_stored(scale) if self.part == "scale" else pack(nv_values(block, scale, gs))
            else:
                scale = mx_scales(block)
                out = mx_exponents(scale) if self.part == "scale" else pack(mx_values(block, scale))
            yield host_bytes(out)


def _member_bands(member: Member, compute: str, reader: Reader, space: dict):
    """The member's weight (or its inner transform's output) in bands of whole rows, in ``compute``."""
    ref, stream = member.source, None
    if member.inner is not None:
        stream = PieceStream(member.inner.pieces(Computed(member.name, ref, compute), reader, space))
        ref = ref._replace(dtype=compute)
    return _bands(ref, compute, reader, stream, rows_of="rows", budget=FP4_BAND, device=device_of(space))


def global_scale(group: tuple[Member, ...], compute: str, reader: Reader, space: dict):
    """NVFP4's global scale of ``group``: one streaming pass over its tensors' max and min (kept in
    ``space`` under the group's names, so the group is read once for all its outputs), then the
    observer's ``get_global_scale`` and ``generate_gparam``."""
    import torch

    key = ("nvfp4-global", compute, tuple(m.name for m in group))
    if key in space:
        return space[key]
    stats = []
    for member in group:
        lo = hi = None
        for block in _member_bands(member, compute, reader, space):
            blo, bhi = torch.amin(block), torch.amax(block)
            lo, hi = (blo, bhi) if lo is None else (torch.min(lo, blo), torch.max(hi, bhi))
        stats.append((lo, hi))
    absmax = stats[0][1]
    for lo, hi in stats:
        absmax = torch.max(torch.max(absmax, -lo), hi)
    zero = torch.zeros(1, dtype=absmax.dtype, device=absmax.device)
    lo, hi = torch.min(-absmax.reshape(1), zero), torch.max(absmax.reshape(1), zero)
    pos = torch.max(torch.abs(lo), torch.abs(hi))
    pos = torch.clamp(pos, min=torch.finfo(pos.dtype).tiny)
    gs = torch.nan_to_num(FP8_MAX * FP4_MAX / pos, nan=1.0, posinf=1.0, neginf=1.0).to(torch.float32).reshape([1])
    space[key] = gs
    return gs


def _absmax(block, size: int):
    """Each group's max(|min ∧ 0|, |max ∨ 0|), as calculate_qparams takes it, shape [rows, groups]."""
    import torch

    groups = block.unflatten(-1, (-1, size))
    lo, hi = torch.amin(groups, dim=-1), torch.amax(groups, dim=-1)
    lo, hi = torch.min(lo, torch.zeros_like(lo)), torch.max(hi, torch.zeros_like(hi))
    return torch.max(torch.abs(lo), torch.abs(hi))


def nv_scales(block, gs):
    """NVFP4 group scales in float32: e4m3(gs * absmax / 6), a zero replaced by 0.125."""
    import torch

    absmax = _absmax(block, GROUP["nv"])
    bit_range = torch.tensor(FP4_MAX, device=block.device) - torch.tensor(-FP4_MAX, device=block.device)
    scales = gs * (absmax / (bit_range.to(absmax.dtype) / 2))
    fp8 = torch.finfo(torch.float8_e4m3fn)
    scales = torch.clamp(scales, fp8.min, fp8.max).to(torch.float8_e4m3fn).to(scales.dtype)
    scales = torch.where(scales == 0, torch.tensor(0.125, dtype=scales.dtype, device=scales.device), scales)
    return scales.to(block.dtype)  # update_qparams copies them into a parameter of the weight's dtype


def nv_scales_stored(scales):
    """The group scales as the NVFP4 compressor stores them: E4M3 (exact: they are E4M3 values)."""
    import torch

    return scales.to(torch.float8_e4m3fn)


def nv_values(block, scales, gs):
    """FP4 nibbles of the band, as compressed-tensors' _quantize with a global scale rounds them."""
    return _fp4_group(block, scales / gs)


def mx_scales(block):
    """MXFP4 group scales (powers of two in the weight's dtype), as calculate_qparams makes them."""
    import torch

    absmax = _absmax(block, GROUP["mx"])
    exps = 127 + torch.floor(torch.log2(_round_to_power_2(absmax))) - 2
    exps = torch.round(torch.clamp(exps, 0, 255)).to(torch.uint8).to(exps.dtype)
    scales = (2.00 ** ((exps.to(torch.int32) - 127).to(torch.float))).to(exps.dtype)
    return torch.where(scales == 0, torch.tensor(1, dtype=scales.dtype, device=scales.device), scales)


def mx_exponents(scales):
    """The E8M0 bytes the MX compressor stores: 127 + floor(log2(scale))."""
    import torch

    return (127 + torch.floor(torch.log2(scales)).to(torch.int32)).to(torch.uint8)


def mx_values(block, scales):
    """FP4 nibbles of the band, as compressed-tensors' _quantize rounds them (the division in ``d``)."""
    return _fp4_group(block, scales)


# dtype -> (its same-width integer, mantissa bits, exponent bits), for round_to_power_2
_LAYOUT = {"bfloat16": ("uint16", 7, 8), "float16": ("uint16", 10, 5), "float32": ("uint32", 23, 8)}


def _round_to_power_2(x):
    """compressed-tensors' round_to_power_2: add 1 << (mantissa - 2) to the bits, keep sign and exponent."""
    import torch

    name = str(x.dtype).removeprefix("torch.")
    int_name, mantissa, exponent = _LAYOUT[name]
    bits = x.view(getattr(torch, int_name)).to(torch.int32)
    mask = ((1 << (exponent + 1)) - 1) << mantissa
    out = torch.bitwise_and(bits + (1 << (mantissa - 1 - 1)), mask)
    return out.to(torch.uint16).view(x.dtype) if int_name == "uint16" else out.view(x.dtype)


def _fp4_group(block, scales):
    """The nibble of each ``block / scale`` (per group, divided in the dtype compressed-tensors
    divides in), clamped to ±6 and rounded to FP4 as cast_to_fp4 on the CPU: one table lookup
    (E2M1) keyed by the quotient's float32 bits. No clamp is needed: beyond 6 (inf too) is 7."""
    import torch

    cols = block.shape[-1]
    groups = block.unflatten(-1, (-1, cols // scales.shape[-1]))
    quotient = groups / scales.unsqueeze(-1)
    if quotient.dtype == torch.float64:  # float32 would round it
        return _fp4_reference(quotient, block.dtype).flatten(start_dim=-2)
    bits = quotient.float().view(torch.int32)  # float32 holds bf16 and f16 exactly
    key = torch.bitwise_right_shift(bits, CUT - 1).bitwise_and_(0xFFE)  # sign, exponent, 2 mantissa bits
    key.add_(torch.bitwise_and(bits, (1 << CUT) - 1).ne_(0))
    nibbles = _table(str(block.device))[key]
    if int(nibbles.max()) >= NAN:  # a NaN among them (a pass over bytes): compressed-tensors' operations
        return _fp4_reference(quotient, block.dtype).flatten(start_dim=-2)
    return nibbles.flatten(start_dim=-2)


def _fp4_reference(x, dtype):
    """The nibbles of ``x`` by compressed-tensors' own operations (cast_to_fp4, the cast back to
    ``dtype``, pack_fp4_to_uint8's index): for the rare band the table does not serve."""
    import torch

    x = torch.clamp(x, -FP4_MAX, FP4_MAX)
    sign, x = torch.sign(x), torch.abs(x)
    x[(x >= 0.0) & (x <= 0.25)] = 0.0
    x[(x > 0.25) & (x < 0.75)] = 0.5
    x[(x >= 0.75) & (x <= 1.25)] = 1.0
    x[(x > 1.25) & (x < 1.75)] = 1.5
    x[(x >= 1.75) & (x <= 2.5)] = 2.0
    x[(x > 2.5) & (x < 3.5)] = 3.0
    x[(x >= 3.5) & (x <= 5.0)] = 4.0
    x[x > 5.0] = 6.0
    values = (x * sign).to(dtype)
    doubled = (values * 2).to(torch.int8).abs_()
    index = torch.zeros_like(doubled, dtype=torch.uint8)
    for twice, i in ((1, 1), (2, 2), (3, 3), (4, 4), (6, 5), (8, 6)):
        index[doubled == twice] = i
    index[doubled >= 12] = 7
    return index | (torch.signbit(values).to(torch.uint8) << 3)


_TABLES: dict = {}


def _table(device: str):
    """E2M1 as a uint8 tensor on ``device`` (made once a device)."""
    import torch

    if device not in _TABLES:
        _TABLES[device] = torch.frombuffer(bytearray(E2M1), dtype=torch.uint8).to(device)
    return _TABLES[device]


def pack(nibbles):
    """pack_fp4_to_uint8's bytes from the nibbles: two a byte, the even column in the low nibble."""
    pairs = nibbles.unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)
