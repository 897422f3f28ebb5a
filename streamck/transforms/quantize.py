"""FP8 weights and their scales, computed as llm-compressor 0.14.0.1's ``model_free_ptq`` computes
them (compressed-tensors 0.19's observer, ``calculate_qparams`` and ``quantize``), band by band.

The arithmetic is torch's, the oracle's own operations on the same dtypes, so the bits are the
same: every step is elementwise (a division rounded to the weight's dtype, a clamp, a cast to
E4M3 with ties to even) or an exact reduction (a max of absolute values), so a band of rows
gives the bits the whole tensor gives.

- ``channel`` (FP8_DYNAMIC): one scale per output row, ``absmax / 448`` in the weight's dtype
  (a zero becomes that dtype's epsilon: 2^-7 in bf16); values ``e4m3(clamp(w / scale))``, the
  division rounded to the weight's dtype first.
- ``block`` (FP8_BLOCK): the same per 128×128 tile, the last tiles zero-padded (which leaves
  the absmax as it is); the scale grid is [⌈rows/128⌉, ⌈cols/128⌉].

Memory: one band of rows (at most BAND_BYTES of source, or 128 rows for ``block``) and a few
temporaries of its size. torch is imported inside the computation only. On a CUDA device
(``--device``) each band is computed there and its result copied back: the same operations on
the same dtypes, elementwise or exact, so the same bits.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from streamck.dtypes import BITS, TORCH_NAMES
from streamck.errors import OutputError
from streamck.source import TensorRef
from streamck.source.reader import Reader
from streamck.transforms.base import Computed, PieceStream, Transform, device_of

TILE = 128
FP8_MAX = 448.0
BAND_BYTES = 2 << 20
SCHEME_OF = {"channel": "FP8_DYNAMIC", "block": "FP8_BLOCK"}


def band_rows(rows: int, cols: int, size: int, strategy: str, budget: int = BAND_BYTES) -> list[tuple[int, int]]:
    """[start, end) row bands of about ``budget`` bytes (``size`` bytes an element); for ``block``
    a multiple of 128 rows (the last band may be short)."""
    unit = TILE if strategy == "block" else 1
    step = max(unit, budget // max(cols * size, 1) // unit * unit)
    return [(s, min(s + step, rows)) for s in range(0, rows, step)]


@dataclass(frozen=True, slots=True)
class Fp8:
    """One output of an FP8-quantized weight: ``part`` "weight" (the E4M3 values) or "scale",
    by ``strategy`` "channel" or "block"; ``compute`` is the dtype the weight is quantized
    from (its output dtype under the rules: a --dtype cast comes first), the scales' dtype."""

    part: str
    strategy: str
    compute: str
    engine: str = "torch"
    exact: bool = True
    # The transform whose output is quantized (a LoRA merge), read as it computes it; None: the source.
    inner: Transform | None = None

    @property
    def label(self) -> str:
        merged = f"{self.inner.label} " if self.inner is not None and self.inner.label else ""
        return f"{merged}{SCHEME_OF[self.strategy]} {self.part}"

    def inputs(self) -> tuple[TensorRef, ...]:
        return () if self.inner is None else self.inner.inputs()

    def origin(self, source: TensorRef) -> TensorRef:
        return source if self.inner is None else self.inner.origin(source)

    def pieces(self, target, reader: Reader, space: dict) -> Iterator[memoryview]:
        """The part's bytes, one band of rows at a time (see the module's docstring)."""

        ref, stream = target.source, None
        if self.inner is not None:  # the merged weight, in the dtype it is quantized from
            computed = Computed(target.name, ref, self.compute)
            stream = PieceStream(self.inner.pieces(computed, reader, space))
            ref = ref._replace(dtype=self.compute)
        for block in _bands(ref, self.compute, reader, stream, device=device_of(space)):
            scale = _scales(block, self.strategy)
            out = scale if self.part == "scale" else _quantize(block, scale, self.strategy)
            yield host_bytes(out)


def host_bytes(out) -> memoryview:
    """A computed tensor's bytes in host memory (copied back from a device)."""
    import torch

    return memoryview(out.contiguous().view(torch.uint8).cpu().numpy()).cast("B")


def _bands(ref: TensorRef, compute: str, reader: Reader, stream: PieceStream | None = None, rows_of: str = "block",
           budget: int = BAND_BYTES, device: str = "cpu"):  # fmt: skip
    """``ref`` (or what ``stream`` yields in ``ref``'s dtype and shape) as tensors of ``compute``
    dtype on ``device``, one band of rows at a time: whole 128-row tiles (``rows_of`` "block",
    which serves both FP8 strategies) or any rows ("rows")."""
    import torch

    rows, cols = ref.shape
    size = BITS[ref.dtype] // 8
    src, dst = getattr(torch, TORCH_NAMES[ref.dtype]), getattr(torch, TORCH_NAMES[compute])
    stream = reader.stream(ref) if stream is None else stream
    for start, end in band_rows(rows, cols, size, rows_of, budget):
        buf = bytearray((end - start) * cols * size)
        if stream.readinto(memoryview(buf)) != len(buf):
            raise OutputError(f"{ref.name} ended early", ref.path)
        yield torch.frombuffer(buf, dtype=src).reshape(end - start, cols).to(device).to(dst)


def _pad(block, rows: int, cols: int):
    """``block`` zero-padded to ``rows`` × ``cols`` (compressed-tensors pads block tiles so)."""
    import torch

    if block.shape == (rows, cols):
        return block
    return torch.nn.functional.pad(block, (0, cols - block.shape[1], 0, rows - block.shape[0]))


def _tiles(block):
    """The padded band as (row tiles, col tiles, 128, 128)."""
    rows, cols = block.shape
    rt, ct = -(-rows // TILE), -(-cols // TILE)
    return _pad(block, rt * TILE, ct * TILE).reshape(rt, TILE, ct, TILE).transpose(1, 2)


def _scales(block, strategy: str):
    """The band's scales as calculate_qparams makes them: max(|min∧0|, |max∨0|) / (896/2) in the
    weight's dtype, a zero scale replaced by the dtype's epsilon."""
    import torch

    if strategy == "channel":
        lo, hi = torch.amin(block, dim=-1, keepdim=True), torch.amax(block, dim=-1, keepdim=True)
    else:
        tiles = _tiles(block)
        lo, hi = torch.amin(tiles, dim=(-2, -1)), torch.amax(tiles, dim=(-2, -1))
    lo, hi = torch.min(lo, torch.zeros_like(lo)), torch.max(hi, torch.zeros_like(hi))
    absmax = torch.max(torch.abs(lo), torch.abs(hi))
    q_range = torch.tensor(FP8_MAX, device=block.device) - torch.tensor(-FP8_MAX, device=block.device)
    scales = absmax / (q_range.to(absmax.dtype) / 2)
    eps = torch.tensor(torch.finfo(scales.dtype).eps, dtype=scales.dtype, device=block.device)
    return torch.where(scales == 0, eps, scales)


def _quantize(block, scales, strategy: str):
    """E4M3 values of the band: clamp(w / scale, ±448) cast with ties to even, the division
    rounded to the weight's dtype (as compressed-tensors' _quantize does)."""
    import torch

    lo, hi = torch.tensor(-FP8_MAX, device=block.device), torch.tensor(FP8_MAX, device=block.device)
    if strategy == "channel":
        values = torch.clamp(block / scales, lo, hi).to(torch.float8_e4m3fn)
    else:
        rows, cols = block.shape
        tiles = torch.clamp(_tiles(block) / scales[..., None, None], lo, hi).to(torch.float8_e4m3fn)
        rt, ct = tiles.shape[:2]
        values = tiles.transpose(1, 2).reshape(rt * TILE, ct * TILE)[:rows, :cols]
    # A NaN value needs a NaN or infinite scale (a NaN weight makes its scale NaN): checked on the scales.
    return values if bool(torch.isfinite(scales).all()) else _positive_nan(values)


def _positive_nan(values):
    """``values`` (E4M3) with each NaN as 0x7F: compressed-tensors casts them back to the weight's
    dtype and again to E4M3, and that round trip drops a NaN's sign (0xFF); other values are exact."""
    import torch

    raw = values.contiguous().view(torch.uint8)
    return torch.where(raw == 0xFF, torch.tensor(0x7F, dtype=torch.uint8, device=raw.device), raw)
