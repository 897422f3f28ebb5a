"""gpt-oss's experts as GGUF writes them (``convert_hf_to_gguf.py``'s ``GptOssModel``), in numpy.

Two transforms, one per layout a gpt-oss folder comes in:

* ``Mxfp4Repack``, the published layout: ``<proj>_blocks`` U8 [E, R, G, 16] (32 E2M1 values a
  group, two a byte, value ``2j`` in byte ``j``'s low nibble and ``2j + 1`` in its high one) with
  ``<proj>_scales`` U8 [E, R, G] (one E8M0 exponent a group) become GGML's ``block_mxfp4``
  ([E, R, G × 17] bytes, the logical [E, R, G × 32]): the exponent byte first, then 16 bytes
  whose low nibbles hold values 0..15 and high nibbles values 16..31 (``repack_mxfp4`` and its
  ``transform_nibble_layout``). Bits only move: nothing goes through floats. The source may be a
  row selection of the blocks (gate and up are the fused tensor's even and odd rows), read as
  such (streamck.source.select).
* ``TransposedExperts``, what ``save_pretrained`` writes in bf16: fused ``gate_up_proj`` [E, H, 2I]
  and ``down_proj`` [E, I, H], each expert transposed (``transpose(-1, -2)``) and, for gate and
  up, its even or odd rows taken, then converted as the reference converts it: widened to
  float32, then gguf-py's own ``quants.quantize`` to the file's type (F32, F16, BF16, Q8_0).

Memory: a band of rows (BAND_BYTES of blocks) for the first; one expert's source bytes and a
band of its transposed rows in float32 for the second.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from streamck.errors import OutputError
from streamck.source import TensorRef
from streamck.source.reader import Reader
from streamck.transforms.base import OwnSource

GROUP_BYTES = 16  # 32 E2M1 values a group, two a byte
GGML_BLOCK_BYTES = 17  # block_mxfp4: the E8M0 exponent, then 16 bytes of nibbles
BAND_BYTES = 1 << 20  # blocks read at once by Mxfp4Repack
BAND_VALUES = 1 << 20  # transposed values converted at once by TransposedExperts
_ITEM = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}


def repack(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Blocks U8 [..., 16] and their exponents U8 [...] as GGML ``block_mxfp4`` U8 [..., 17]."""
    values = np.empty((*blocks.shape[:-1], 32), np.uint8)
    values[..., 0::2] = blocks & 0x0F
    values[..., 1::2] = blocks >> 4
    out = np.empty((*blocks.shape[:-1], GGML_BLOCK_BYTES), np.uint8)
    out[..., 0] = scales
    out[..., 1:] = values[..., :16] | (values[..., 16:] << 4)
    return out


def _read(stream, size: int, ref: TensorRef) -> np.ndarray:
    """The next ``size`` bytes of ``stream`` (over ``ref``) as U8; OutputError where it ends early."""
    buf = bytearray(size)
    if stream.readinto(memoryview(buf)) != size:
        raise OutputError(f"{ref.name}: its source ended early", ref.path)
    return np.frombuffer(buf, np.uint8)


@dataclass(frozen=True, slots=True)
class Mxfp4Repack(OwnSource):
    """The output's source (blocks U8 [E, R, G, 16], or a row selection of them) with ``scale``
    (U8 [E, R, G], the same rows) as GGML MXFP4: the output is its bytes (U8 [E, R, G × 17]);
    ``shape`` is the logical [E, R, G × 32] GGUF records with ``ggml_type``."""

    scale: TensorRef
    shape: tuple[int, ...]
    ggml_type: str = "MXFP4"
    label: str = "MXFP4 repacked"
    engine: str = "numpy"
    exact: bool = True

    def inputs(self) -> tuple[TensorRef, ...]:
        return (self.scale,)

    def pieces(self, target, reader: Reader, space: dict) -> Iterator[memoryview]:
        """The MXFP4 bytes, a band of whole rows at a time."""
        ref = target.source
        groups = ref.shape[-2]
        rows = math.prod(ref.shape[:-2])
        step = max(1, BAND_BYTES // (groups * GROUP_BYTES))
        blocks, scales = reader.stream(ref), reader.stream(self.scale)
        for start in range(0, rows, step):
            n = min(step, rows - start)
            b = _read(blocks, n * groups * GROUP_BYTES, ref).reshape(n, groups, GROUP_BYTES)
            s = _read(scales, n * groups, self.scale).reshape(n, groups)
            yield memoryview(repack(b, s)).cast("B")


def widen(values: np.ndarray, dtype: str) -> np.ndarray:
    """``dtype`` values (bfloat16's as uint16) as float32, exactly (bfloat16 is float32's upper half)."""
    if dtype == "BF16":
        return (values.astype(np.uint32) << 16).view(np.float32)
    return values.astype(np.float32)


@dataclass(frozen=True, slots=True)
class TransposedExperts(OwnSource):
    """The output's source (fused experts [E, A, B], a float dtype) with each expert transposed
    to [B, A] and its rows ``offset::every`` kept: the logical ``shape`` [E, B / every, A] in
    ``ggml_type`` (F32, F16, BF16 or Q8_0, gguf-py's ``quants.quantize`` of the float32 values,
    as the reference writes them); the output is its bytes (U8)."""

    shape: tuple[int, ...]
    ggml_type: str
    every: int = 1
    offset: int = 0
    engine: str = "numpy"
    exact: bool = True

    @property
    def label(self) -> str:
        return f"transposed, {self.ggml_type}"

    def pieces(self, target, reader: Reader, space: dict) -> Iterator[memoryview]:
        """The converted bytes, one expert read at a time, a band of its output rows converted at once."""
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize

        ref = target.source
        experts, a, b = ref.shape
        kind = GGMLQuantizationType[self.ggml_type]
        step = max(1, BAND_VALUES // max(a, 1))
        stream = reader.stream(ref)
        item = np.dtype(_ITEM[ref.dtype]).itemsize
        for _ in range(experts):
            expert = _read(stream, a * b * item, ref).view(_ITEM[ref.dtype]).reshape(a, b)
            rows = expert.T[self.offset :: self.every]  # a view: nothing copied yet
            for start in range(0, rows.shape[0], step):
                band = widen(rows[start : start + step], ref.dtype)
                yield memoryview(np.ascontiguousarray(quantize(band, kind))).cast("B")


__all__ = ["Mxfp4Repack", "TransposedExperts", "repack"]
