"""A LoRA merge (streamck.transforms.lora.LoraMerge) block by block with torch: PEFT's bits.

PEFT computes a whole tensor's delta with one GEMM; this computes it for a block of rows at
a time, which gives the same bits only when the CPU GEMM sums each element's r products in
the same order whatever the number of rows. torch's CPU GEMM does for blocks of a multiple
of 16 rows, but not for a block of 1 to 3, 5 to 7 or 9 to 11 rows (another kernel takes
those): so blocks are a multiple of 16 rows and a short last block joins the one before.
The same holds for an embedding's blocks of columns of A. tests/test_lora_blocks.py checks
both for r up to 256 against the whole-tensor product, and the row-wise norm DoRA takes.
Memory is one block of W in fp32 (about MERGE_CHUNK bytes) a few times over, plus A. The
blocks depend on the tensor's shape only (merge_blocks), never on a writer's chunk: --verify
computes a merge again in the same blocks, so it gets the same bits.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from streamck.dtypes import TORCH_NAMES
from streamck.errors import OutputError
from streamck.source.header import TensorRef
from streamck.source.reader import Reader
from streamck.transforms.base import Target
from streamck.transforms.lora import LoraMerge, copy_blocks, merge_blocks

_threads_lock = threading.Lock()
_threads_users = 0
_threads_before = 1


@contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread while any merge runs, as before after the last. The work is
    memory-bound (a GEMM of r products per element, then a pass or two over the block), and
    a second OpenMP thread only waits: on a busy 2-core host it doubled the CPU time and
    tripled the wall time. Jobs (--jobs) merge on their own threads."""
    import torch

    global _threads_users, _threads_before
    with _threads_lock:
        if _threads_users == 0:
            _threads_before = torch.get_num_threads()
            torch.set_num_threads(1)
        _threads_users += 1
    try:
        yield
    finally:
        with _threads_lock:
            _threads_users -= 1
            if _threads_users == 0:
                torch.set_num_threads(_threads_before)


def _torch_dtype(dtype: str):
    import torch

    return getattr(torch, TORCH_NAMES[dtype])


def _whole(reader: Reader, ref: TensorRef):
    """All of ``ref`` upcast to fp32 (PEFT upcasts adapters on load: autocast_adapter_dtype)."""
    import torch

    buf = bytearray(ref.nbytes)
    if reader.stream(ref).readinto(memoryview(buf)) != ref.nbytes:
        raise OutputError(f"{ref.name} ended early", ref.path)
    return torch.frombuffer(buf, dtype=_torch_dtype(ref.dtype)).float().reshape(ref.shape) if buf else torch.empty(0)


@dataclass(frozen=True, slots=True)
class TorchMerge(LoraMerge):
    """A LoRA merge computed with torch on the CPU: PEFT's bits."""

    engine = "torch"
    exact = True

    def pieces(self, target: Target, reader: Reader, space: dict) -> Iterator[memoryview]:
        return merged_pieces(self, target, reader, space)


def merged_pieces(m: LoraMerge, t: Target, reader: Reader, space: dict | None = None) -> Iterator[memoryview]:
    """``t``'s bytes, computed (see _merged), with torch on one thread. ``space`` keeps the
    buffers from one tensor to the next (a writer's own dict: one per thread)."""
    with one_thread():
        yield from _merged(m, t, reader, {} if space is None else space)


def _merged(m: LoraMerge, t: Target, reader: Reader, space: dict) -> Iterator[memoryview]:
    """``t``'s bytes, computed: W and the LoRA delta summed in fp32 as PEFT sums them, rounded
    to W's dtype, then cast to ``t.dtype`` when that differs. Each view is valid until the next."""
    w = t.source
    if m.kind == "bias":
        total = _whole(reader, w) + _whole(reader, m.b) * m.scale
        yield from _emit(t, total.to(_torch_dtype(w.dtype)), m.safe)
        return
    if m.kind == "copy":
        yield from _copied(m, t, reader)
        return
    rows, cols = w.shape
    magnitude = _whole(reader, m.magnitude) if m.magnitude is not None else None
    job = _Job(m, _torch_dtype(w.dtype), cols, _whole(reader, m.a), _whole(reader, m.b), magnitude)
    blocks = merge_blocks(rows, cols)
    size = w.nbytes // max(w.numel, 1)
    slot = _slot(space, max(e - s for s, e in blocks) * cols, size, job.wdtype)
    stream = reader.stream(w)
    for start, end in blocks:
        view = memoryview(slot.raw)[: (end - start) * cols * size]
        if stream.readinto(view) != len(view):
            raise OutputError(f"{w.name} ended early", w.path)
        yield from _emit(t, job.compute(slot, start, end), m.safe)


def _copied(m: LoraMerge, t: Target, reader: Reader) -> Iterator[memoryview]:
    """A saved copy rounded to W's dtype, then cast to ``t.dtype``, block by block."""
    import torch

    copy, stream = m.b, reader.stream(m.b)
    for _, nbytes in copy_blocks(copy):
        buf = bytearray(nbytes)
        if stream.readinto(memoryview(buf)) != nbytes:
            raise OutputError(f"{copy.name} ended early", copy.path)
        block = torch.frombuffer(buf, dtype=_torch_dtype(copy.dtype)).to(_torch_dtype(t.source.dtype))
        yield from _emit(t, block, False)


def _slot(space: dict, count: int, size: int, wdtype) -> _Slot:
    """The buffers in ``space``, grown to hold ``count`` elements of ``size`` bytes: fresh
    ones per tensor let the heap grow with the number of tensors (peak RSS 261 MiB at 1 GiB,
    280 MiB at 4 GiB)."""
    slot = space.get("slot")
    if slot is None or slot.out.dtype != wdtype or slot.count < count or len(slot.raw) < count * size:
        slot = space["slot"] = _Slot(count, size, wdtype)
    return slot


class _Slot:
    """One block's buffers, flat: W's bytes as read, W and the sum in fp32, the delta, the result."""

    def __init__(self, count: int, size: int, wdtype):
        import torch

        self.count, self.raw = count, bytearray(count * size)
        self.total, self.delta = torch.empty(count), torch.empty(count)
        self.out = torch.empty(count, dtype=wdtype)


class _Job:
    """One tensor's merge: A and B (fp32), the DoRA magnitude, and PEFT's operations on a block."""

    def __init__(self, merge, wdtype, cols: int, a, b, magnitude):
        self.m, self.wdtype, self.cols, self.a, self.b, self.magnitude = merge, wdtype, cols, a, b, magnitude

    def compute(self, slot: _Slot, start: int, end: int):
        """Rows [start, end) of the merged tensor in W's dtype, from W's bytes in ``slot.raw``."""
        import torch

        m, a, b = self.m, self.a, self.b
        n, cols = end - start, self.cols
        block = slot.total[: n * cols].view(n, cols)
        block.copy_(torch.frombuffer(slot.raw, dtype=self.wdtype, count=n * cols).reshape(n, cols))
        if m.transposed:  # (B @ A[:, rows])^T * s
            d = torch.matmul(b, a[:, start:end], out=slot.delta[: n * cols].view(cols, n)).mul_(m.scale).T
        else:  # (B[rows] @ A) * s
            d = torch.matmul(b[start:end], a, out=slot.delta[: n * cols].view(n, cols)).mul_(m.scale)
        if m.round_delta:
            d = d.to(self.wdtype).float()
        block.add_(d)
        if self.magnitude is not None:  # DoRA: each row to magnitude / its norm
            block.mul_((self.magnitude[start:end] / torch.linalg.norm(block, dim=1)).view(-1, 1))
        return slot.out[: n * cols].view(n, cols).copy_(block)


def _emit(t: Target, out, safe: bool) -> Iterator[memoryview]:
    """``out`` (the merge rounded to W's dtype) as bytes, cast to ``t.dtype`` when asked."""
    import torch

    if safe and not torch.isfinite(out).all():
        raise OutputError(f"NaNs or infinities in the merged {t.name}: the adapter seems broken (safe_merge)")
    if t.dtype != t.source.dtype:
        out = out.to(_torch_dtype(t.dtype))
    yield memoryview(out.contiguous().view(torch.uint8).numpy()).cast("B")
