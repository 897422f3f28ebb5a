"""gpt-oss's MXFP4 experts back to floats, as transformers 5.19 loads them with
``Mxfp4Config(dequantize=True)`` (``integrations/mxfp4.py``, ``convert_moe_packed_tensors``).

The published checkpoints store ``experts.gate_up_proj_blocks`` U8 [E, 2I, H/32, 16] with
``_scales`` U8 [E, 2I, H/32] and ``experts.down_proj_blocks`` [E, H, I/32, 16] with ``_scales``
[E, H, I/32]: 32 E2M1 values a group (two a byte, the low nibble first, bit 3 the sign), one E8M0
exponent a group. transformers looks each nibble up in a bfloat16 table, ``ldexp``s it by the
exponent less 127 into bfloat16, and transposes the last two axes, so the runtime tensors are
``gate_up_proj`` [E, H, 2I] (gate and up columns interleaved as stored) and ``down_proj`` [E, I, H],
bfloat16 whatever the model's dtype (cast once more to the output dtype here).

Memory: one expert's packed bytes and scales (``[R, G, 16]`` + ``[R, G]``), and one band of output
rows (whole groups: 32 rows of the transposed tensor each) in bfloat16 with its int32 indices.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from streamck.dtypes import TORCH_NAMES
from streamck.source import TensorRef
from streamck.source.reader import Reader
from streamck.transforms.base import device_of
from streamck.transforms.dequantize import row_bands
from streamck.transforms.quantize import host_bytes

# transformers' FP4_VALUES: the E2M1 value of each nibble, sign bit 3
E2M1_SIGNED = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP_BYTES = 16  # 32 values a group, two a byte
# A band of output: this many values (~15 bytes each in temporaries); smaller bands cost more in
# per-band overhead than they save (2 groups of gpt-oss-20b's rows: 2.3× the time of 11)
BAND_VALUES = 1 << 20


@dataclass(frozen=True, slots=True)
class Mxfp4ExpertsDequant:
    """gpt-oss's fused MXFP4 experts (the output's source: ``<proj>_blocks`` [E, R, G, 16]) with
    their E8M0 ``scale`` (``<proj>_scales`` [E, R, G]), as transformers dequantizes them: the
    output [E, G × 32, R]."""

    scale: TensorRef
    engine: str = "torch"
    exact: bool = True

    @property
    def label(self) -> str:
        return "MXFP4 unpacked"

    def inputs(self) -> tuple[TensorRef, ...]:
        return (self.scale,)

    def origin(self, source: TensorRef) -> TensorRef:
        return source

    def pieces(self, target, reader: Reader, space: dict) -> Iterator[memoryview]:
        """The output's bytes: expert by expert, a band of whole groups' rows at a time."""
        import torch

        ref = target.source
        experts, rows, groups, _ = ref.shape
        out = getattr(torch, TORCH_NAMES[target.dtype])
        device = device_of(space)
        lut = torch.tensor(E2M1_SIGNED, dtype=torch.bfloat16, device=device)
        step = max(1, BAND_VALUES // max(rows * 32, 1))
        blocks = row_bands(reader, ref, experts, rows * groups * GROUP_BYTES, 1, device)
        scales = row_bands(reader, self.scale, experts, rows * groups, 1, device)
        for (_, _, b), (_, _, s) in zip(blocks, scales, strict=True):
            b, s = b.reshape(rows, groups, GROUP_BYTES), s.reshape(rows, groups)
            for g in range(0, groups, step):
                n = min(step, groups - g)
                values = unpack_ldexp(b[:, g : g + n].reshape(-1, GROUP_BYTES), s[:, g : g + n].reshape(-1, 1), lut)
                yield host_bytes(values.reshape(rows, n * 32).t().to(out))


def unpack_ldexp(blocks, scales, lut):
    """transformers' ``_convert_moe_packed_tensors`` on one chunk of group rows: blocks U8 [n, 16],
    scales U8 [n, 1] -> bfloat16 [n, 32] (low nibbles at the even columns), the same operations."""
    import torch

    sub = torch.empty(blocks.shape[0], 2 * blocks.shape[1], dtype=lut.dtype, device=blocks.device)
    sub[:, 0::2] = lut[(blocks & 0x0F).to(torch.int)]
    sub[:, 1::2] = lut[(blocks >> 4).to(torch.int)]
    torch.ldexp(sub, scales.to(torch.int32) - 127, out=sub)
    return sub


def output_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """[E, G × 32, R] for blocks [E, R, G, 16]."""
    experts, rows, groups, _ = blocks_shape
    return (experts, groups * 32, rows)


__all__ = ["GROUP_BYTES", "Mxfp4ExpertsDequant", "output_shape", "unpack_ldexp"]
