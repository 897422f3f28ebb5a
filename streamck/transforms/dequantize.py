"""FP8 weights back to floats, as transformers 5.19 loads them, band by band.

- ``fp8`` (DeepSeek-V3 layout: ``weight`` E4M3 + ``weight_scale_inv`` per 128×128 block, the
  config's ``quant_method: fp8``): transformers' ``Fp8Dequantize`` (FineGrainedFP8Config with
  ``dequantize=True``) multiplies in float32, ``f32(q) * f32(s)``, and rounds once to the
  model's dtype.
- ``compressed-tensors`` (``weight`` E4M3 + ``weight_scale`` per row, per tensor or per block):
  transformers loads the scale into the model's dtype first, then compressed-tensors'
  decompressor multiplies in the scale's dtype: ``d(q) * d(s)`` rounded to ``d``, the output
  dtype (so a float32 output is not the bf16 product widened).

Each product is elementwise, so a band of rows gives the whole tensor's bits. Memory: the
scale tensor (one value per block or row) and one band of rows in float32, a few times over.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from streamck.dtypes import TORCH_NAMES
from streamck.errors import OutputError
from streamck.source import TensorRef
from streamck.source.reader import Reader
from streamck.transforms.quantize import BAND_BYTES


@dataclass(frozen=True, slots=True)
class Fp8Dequant:
    """An E4M3 weight times its ``scale`` (one per ``block`` of rows × columns; a scale of shape
    [rows, 1] or [1] broadcasts), in float32 then cast to the output dtype (``kind`` "fp8"), or
    in the output dtype ("compressed-tensors")."""

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
        """The dequantized weight's bytes, one band of whole block rows at a time."""
        import torch

        ref, (bh, bw) = target.source, self.block
        rows, cols = ref.shape
        out = getattr(torch, TORCH_NAMES[target.dtype])
        math = torch.float32 if self.kind == "fp8" else out
        scales = _whole(reader, self.scale).to(math)
        if scales.dim() == 2 and (scales.shape[0] > 1 or bh > 1):  # a grid (or per-row scales)
            scales = scales.repeat_interleave(bw, dim=1)[:, :cols] if bw > 1 else scales
        step = max(bh, BAND_BYTES // max(cols * 4, 1) // bh * bh)
        stream = reader.stream(ref)
        for start in range(0, rows, step):
            end = min(start + step, rows)
            buf = bytearray((end - start) * cols)
            if stream.readinto(memoryview(buf)) != len(buf):
                raise OutputError(f"{ref.name} ended early", ref.path)
            q = torch.frombuffer(buf, dtype=torch.float8_e4m3fn).reshape(end - start, cols).to(math)
            s = _rows_of(scales, start, end, bh)
            yield memoryview((q * s).to(out).contiguous().view(torch.uint8).numpy()).cast("B")


def _rows_of(scales, start: int, end: int, bh: int):
    """The scales of rows [start, end): a grid's block rows repeated, per-row scales sliced,
    a single scale as it is."""
    if scales.dim() < 2 or (scales.shape[0] == 1 and bh == 1):
        return scales
    if bh == 1:
        return scales[start:end]
    first = start // bh
    band = scales[first : -(-end // bh)].repeat_interleave(bh, dim=0)
    return band[start - first * bh : end - first * bh]


def _whole(reader: Reader, ref: TensorRef):
    """All of a (small) scale tensor."""
    import torch

    buf = bytearray(ref.nbytes)
    if reader.stream(ref).readinto(memoryview(buf)) != ref.nbytes:
        raise OutputError(f"{ref.name} ended early", ref.path)
    return torch.frombuffer(buf, dtype=getattr(torch, TORCH_NAMES[ref.dtype])).reshape(ref.shape)
