"""Quantized weights back to floats, as transformers 5.19 and compressed-tensors 0.19 load them,
band by band.

- ``fp8`` (FineGrainedFP8, DeepSeek-V3's layout: ``weight`` E4M3 + ``weight_scale_inv`` F32, BF16
  or E8M0 (``scale_fmt: ue8m0``) per ``weight_block_size`` tile, the config's ``quant_method:
  fp8``): transformers' ``Fp8Dequantize`` (FineGrainedFP8Config with ``dequantize=True``)
  multiplies in float32, ``f32(q) * f32(s)``, and rounds once to the model's dtype. Each tile is
  multiplied by its own scale, a partial last tile included (the block math; transformers 5.19
  infers the tile as rows ÷ scale rows, which is the same wherever the tiles are whole). Fused
  experts [E, rows, cols] have a scale grid per expert ([E, ⌈rows/128⌉, ⌈cols/128⌉]).
- ``compressed-tensors`` (``weight`` E4M3 + ``weight_scale`` per row, per tensor, per group or per
  block): transformers loads the scale into the model's dtype first, then compressed-tensors'
  decompressor multiplies in the scale's dtype: ``d(q) * d(s)`` rounded to ``d``, the output
  dtype (so a float32 output is not the bf16 product widened).

- packed FP4 (``weight_packed`` U8, two E2M1 values a byte, the even column in the low nibble,
  bit 3 the sign): compressed-tensors' ``NVFP4PackedCompressor.decompress`` (its subclass
  ``MXFP4PackedCompressor`` for MXFP4), which transformers runs on ``dequantize=True``. It
  unpacks to bfloat16 whatever the model's dtype (``unpack_fp4_from_uint8``'s default), so the
  weight is always that bfloat16 tensor, cast once more to the output dtype (transformers leaves
  it bfloat16 even in a float32 model). NVFP4 (``weight_scale`` E4M3 per 16 values,
  ``weight_global_scale`` F32 [1]): ``bf16(f32(v) * (f32(bf16(s)) / gs))``, the division and
  the product each rounded to float32 (bfloat16 over a float32 tensor promotes). MXFP4
  (``weight_scale`` U8 E8M0 per 32 values): ``bf16(v) * bf16(2 ** bf16(e - 127))`` in bfloat16.
  (gpt-oss's own MXFP4 experts: streamck.transforms.dequantize_gptoss.)

Each product is elementwise, so a band of rows gives the whole tensor's bits, and on a CUDA
device (``--device``) the same operations give the same bits (each band computed there and
copied back). Memory: the scale tensor (one value per tile or row; FP4's group scales a band at a
time) and one band of about FP8_VALUES / FP4_VALUES values, ~11 bytes a value.
"""

from __future__ import annotations

import math as _math
from collections.abc import Iterator
from dataclasses import dataclass

from streamck.dtypes import TORCH, TORCH_NAMES
from streamck.errors import OutputError
from streamck.source import TensorRef
from streamck.source.reader import Reader
from streamck.transforms.base import device_of
from streamck.transforms.fp4 import GROUP
from streamck.transforms.quantize import host_bytes

# A band of FP8 weights: this many values (float32 weights and gathered scales, ~11 bytes each).
FP8_VALUES = 1 << 19


def row_bands(reader: Reader, ref: TensorRef, rows: int, row_bytes: int, step: int, device: str = "cpu"):
    """``ref``'s bytes as ``rows`` rows of ``row_bytes``, read in order ``step`` rows at a time:
    (start, end, uint8 tensor [end - start, row_bytes] on ``device``). OutputError where it ends early."""
    import torch

    stream = reader.stream(ref)
    for start in range(0, rows, step):
        end = min(start + step, rows)
        buf = bytearray((end - start) * row_bytes)
        if stream.readinto(memoryview(buf)) != len(buf):
            raise OutputError(f"{ref.name} ended early", ref.path)
        band = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
        yield start, end, band.reshape(end - start, row_bytes).to(device)


def whole(reader: Reader, ref: TensorRef):
    """All of a (small) scale tensor, in its own dtype."""
    import torch

    (_, _, band), *_ = row_bands(reader, ref, 1, ref.nbytes, 1)
    return band.view(getattr(torch, TORCH[ref.dtype][0])).reshape(ref.shape)  # E8M0 scales too: not castable


@dataclass(frozen=True, slots=True)
class Fp8Dequant:
    """An E4M3 weight [rows, cols] (or fused experts [E, rows, cols]) times its ``scale``: one per
    ``block`` of rows × columns, a partial last tile too (a grid [(E,) ⌈rows/bh⌉, ⌈cols/bw⌉]; per
    row [rows, 1] with block (1, 1); one value [1] or [1, 1] for the tensor), in float32 then cast to
    the output dtype (``kind`` "fp8"), or in the output dtype ("compressed-tensors")."""

    scale: TensorRef
    kind: str
    block: tuple[int, int] = (1, 1)
    engine: str = "torch"
    exact: bool = True

    @property
    def label(self) -> str:
        return f"*{self.scale.name.rpartition('.')[2]}"

    def inputs(self) -> tuple[TensorRef, ...]:
        return (self.scale,)

    def origin(self, source: TensorRef) -> TensorRef:
        return source

    def pieces(self, target, reader: Reader, space: dict) -> Iterator[memoryview]:
        """The dequantized weight's bytes, a band of rows at a time, each row's scales gathered
        from the grid for that band only."""
        import torch

        ref, (bh, bw) = target.source, self.block
        *lead, rows, cols = ref.shape
        total = _math.prod(lead) * rows
        out = getattr(torch, TORCH_NAMES[target.dtype])
        math = torch.float32 if self.kind == "fp8" else out
        device = device_of(space)
        scales = whole(reader, self.scale).to(device).to(math)
        single = scales.numel() == 1
        grid = scales.reshape(-1, scales.shape[-1]) if not single else scales.reshape(())
        per_expert = -(-rows // bh)  # scale rows of one expert
        cidx = torch.arange(cols, device=device) // bw if not single and grid.shape[1] > 1 else None
        for start, end, band in row_bands(reader, ref, total, cols, max(1, FP8_VALUES // max(cols, 1)), device):
            q = band.view(torch.float8_e4m3fn).to(math)
            if single:
                s = grid
            else:
                r = torch.arange(start, end, device=device)
                s = grid.index_select(0, r // rows * per_expert + r % rows // bh)
                s = s if cidx is None else s.index_select(1, cidx)
            yield host_bytes(q.mul_(s).to(out))


# A band of FP4 weights: this many values (float32 and int64 temporaries, ~30 bytes each).
FP4_VALUES = 1 << 18
# E2M1 magnitudes by the nibble's low three bits (compressed-tensors' kE2M1ToFloat)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclass(frozen=True, slots=True)
class Fp4Dequant:
    """A packed FP4 weight (the output's source, ``weight_packed``) with its group ``scale``
    (and NVFP4's ``global_scale``), decompressed by ``kind`` "nv" or "mx" as compressed-tensors
    does (see the module's docstring), then cast to the output dtype."""

    scale: TensorRef
    kind: str
    global_scale: TensorRef | None = None
    engine: str = "torch"
    exact: bool = True

    @property
    def label(self) -> str:
        return f"{'NVFP4' if self.kind == 'nv' else 'MXFP4'} unpacked"

    def inputs(self) -> tuple[TensorRef, ...]:
        return (self.scale,) if self.global_scale is None else (self.scale, self.global_scale)

    def origin(self, source: TensorRef) -> TensorRef:
        return source

    def pieces(self, target, reader: Reader, space: dict) -> Iterator[memoryview]:
        """The weight's bytes, one band of rows at a time (its packed rows and their scales read together)."""
        import torch

        ref = target.source
        rows, half = ref.shape
        groups = self.scale.shape[1]
        out = getattr(torch, TORCH_NAMES[target.dtype])
        device = device_of(space)
        gs = None if self.global_scale is None else whole(reader, self.global_scale).to(device).to(torch.float32)
        step = max(1, FP4_VALUES // max(2 * half, 1))
        packed = row_bands(reader, ref, rows, half, step, device)
        scales = row_bands(reader, self.scale, rows, groups, step, device)
        for (_, _, q), (_, _, s) in zip(packed, scales, strict=True):
            yield host_bytes(fp4_dequant(q, s, gs, self.kind).to(out))


def fp4_unpack(packed):
    """unpack_fp4_from_uint8: each nibble's E2M1 value with its sign (-0 kept), low nibble first,
    in bfloat16 [rows, 2 × cols]."""
    import torch

    low, high = packed & 0x0F, (packed & 0xF0) >> 4
    nibbles = torch.stack((low, high), dim=-1).flatten(start_dim=-2)
    signs = (nibbles & 0x08).to(torch.bool)
    table = torch.tensor(E2M1, dtype=torch.float32, device=packed.device)
    values = table[(nibbles & 0x07).to(torch.long)] * torch.where(signs, -1.0, 1.0)
    return values.to(torch.bfloat16)


def fp4_dequant(packed, scale, global_scale, kind: str):
    """A band of packed FP4 rows with its group scales (E4M3 for ``nv``, E8M0 bytes for ``mx``)
    and NVFP4's global scale, decompressed to bfloat16 as compressed-tensors 0.19 does."""
    import torch

    values = fp4_unpack(packed)
    if kind == "nv":
        s = scale.view(torch.float8_e4m3fn).to(torch.bfloat16)
    else:
        s = (2.0 ** (scale.to(torch.int32) - 127).to(torch.bfloat16)).to(torch.bfloat16)
    s = s.unsqueeze(-1)
    if global_scale is not None:
        s = s / global_scale  # bfloat16 / float32 [1]: float32
    groups = values.unflatten(-1, (scale.shape[-1], GROUP[kind]))
    return (groups.to(s.dtype) * s).flatten(start_dim=-2).to(torch.bfloat16)
