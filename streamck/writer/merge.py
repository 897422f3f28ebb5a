"""Computed tensors: a LoRA merge (streamck.plan.lora.LoraMerge), block by block, with torch.

PEFT computes a whole tensor's delta with one GEMM; this computes it for a block of rows at
a time, which gives the same bits only when the CPU GEMM sums each element's r products in
the same order whatever the number of rows. torch's CPU GEMM does for blocks of a multiple
of 16 rows, but not for a block of 1 to 3, 5 to 7 or 9 to 11 rows (another kernel takes
those): so blocks are a multiple of 16 rows and a short last block joins the one before.
The same holds for an embedding's blocks of columns of A. tests/test_lora_blocks.py checks
both for r up to 256 against the whole-tensor product, and the row-wise norm DoRA takes.
Memory is one block of W in fp32 (about ``chunk`` bytes) a few times over, plus A.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import pairwise

from streamck.dtypes import TORCH_NAMES
from streamck.errors import OutputError
from streamck.plan import OutputTensor
from streamck.source import TensorRef
from streamck.source.reader import Reader

BLOCK_ROWS = 16
# fp32 bytes of W per block: W, the delta and their sum are each about this much.
MERGE_CHUNK = 4 << 20


def row_blocks(rows: int, row_bytes: int, chunk: int) -> list[tuple[int, int]]:
    """[start, end) row ranges of about ``chunk`` bytes (``row_bytes`` each row in fp32), each
    a multiple of BLOCK_ROWS rows but the last, which is at least BLOCK_ROWS rows or all."""
    step = max(BLOCK_ROWS, chunk // max(row_bytes, 1) // BLOCK_ROWS * BLOCK_ROWS)
    edges = [*range(0, rows, step), rows]
    if len(edges) > 2 and edges[-1] - edges[-2] < BLOCK_ROWS:
        del edges[-2]
    return list(pairwise(edges))


def _torch_dtype(dtype: str):
    import torch

    return getattr(torch, TORCH_NAMES[dtype])


def _read(stream, ref: TensorRef, count: int):
    """The next ``count`` elements of ``ref`` from ``stream`` as a 1-D fp32 tensor."""
    import torch

    size = count * ref.nbytes // max(ref.numel, 1)
    buf = bytearray(size)
    if stream.readinto(memoryview(buf)) != size:
        raise OutputError(f"{ref.name} ended early", ref.path)
    return torch.frombuffer(buf, dtype=_torch_dtype(ref.dtype)).float() if size else torch.empty(0)


def _whole(reader: Reader, ref: TensorRef):
    """All of ``ref`` upcast to fp32 (PEFT upcasts adapters on load: autocast_adapter_dtype)."""
    return _read(reader.stream(ref), ref, ref.numel).reshape(ref.shape)


def merged_pieces(t: OutputTensor, reader: Reader, chunk: int) -> Iterator[memoryview]:
    """``t``'s bytes, computed: W and the LoRA delta summed in fp32 as PEFT sums them, rounded
    to W's dtype, then cast to ``t.dtype`` when that differs. Each view is valid until the next."""
    m, w = t.merge, t.source
    if m.kind == "bias":
        yield from _emit(t, _whole(reader, w) + _whole(reader, m.b) * m.scale, m.safe)
        return
    import torch

    rows, cols = w.shape
    a = _whole(reader, m.a)
    b = _whole(reader, m.b) if m.transposed else None
    b_rows = None if m.transposed else reader.stream(m.b)
    magnitude = _whole(reader, m.magnitude) if m.magnitude is not None else None
    w_rows = reader.stream(w)
    for start, end in row_blocks(rows, cols * 4, min(chunk, MERGE_CHUNK)):
        n = end - start
        block = _read(w_rows, w, n * cols).reshape(n, cols)
        if m.transposed:
            delta = (b @ a[:, start:end]).T * m.scale
        else:
            delta = (_read(b_rows, m.b, n * m.b.shape[1]).reshape(n, -1) @ a) * m.scale
        if m.round_delta:
            delta = delta.to(_torch_dtype(w.dtype)).float()
        total = block + delta
        if magnitude is not None:  # DoRA: each row to magnitude / its norm
            total = (magnitude[start:end] / torch.linalg.norm(total, dim=1)).view(-1, 1) * total
        yield from _emit(t, total, m.safe)


def _emit(t: OutputTensor, total, safe: bool) -> Iterator[memoryview]:
    import torch

    out = total.to(_torch_dtype(t.source.dtype))
    if safe and not torch.isfinite(out).all():
        raise OutputError(f"NaNs or infinities in the merged {t.name}: the adapter seems broken (safe_merge)")
    if t.dtype != t.source.dtype:
        out = out.to(_torch_dtype(t.dtype))
    yield memoryview(out.contiguous().view(torch.uint8).numpy()).cast("B")
