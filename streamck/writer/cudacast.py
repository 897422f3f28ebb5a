"""Casting on a CUDA device, with the stages of consecutive chunks overlapped.

Each slot owns pinned host buffers, device buffers and a stream. While the
device copies and casts one chunk, the host reads the next and writes the one
before, so the run is bound by disk or PCIe, not by the CPU. The arithmetic is
torch's, the same conversion as on the CPU, so the bits match the CPU path.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol

from streamck.errors import StreamckError
from streamck.fileio import write_all
from streamck.source.reader import TensorStream
from streamck.writer.cast import ITEMSIZE, can_overflow, chunk_steps, torch_dtype

SLOTS = 2


class Event(Protocol):
    def synchronize(self) -> None: ...


def pipeline(
    steps: Iterable[tuple[int, int]],
    slots: int,
    read: Callable[[int, int, int], None],
    submit: Callable[[int, int], Event],
    write: Callable[[int, int], None],
) -> None:
    """Run every ``(start, count)`` step through read → submit → write, ``slots`` in flight.

    ``read(slot, start, count)`` fills the slot's host input; ``submit(slot, count)``
    queues the device work on it and returns an event; ``write(slot, count)`` writes
    the slot's host output. A slot is read into again only after its event has
    completed and its output was written, so no buffer is touched by the host
    while the device may still use it. Outputs are written in step order.
    """
    pending: deque[tuple[int, int, Event]] = deque()

    def finish() -> None:
        slot, count, event = pending.popleft()
        event.synchronize()
        write(slot, count)

    for i, (start, count) in enumerate(steps):
        if len(pending) == slots:
            finish()
        slot = i % slots
        read(slot, start, count)
        pending.append((slot, count, submit(slot, count)))
    while pending:
        finish()


class CudaCaster:
    """``Caster.cast`` on a CUDA device: ``SLOTS`` sets of buffers of ``chunk`` bytes each."""

    def __init__(self, chunk: int, device: str = "cuda"):
        import torch

        if not torch.cuda.is_available():
            raise StreamckError(f"--device {device}: no usable CUDA device (torch.cuda.is_available() is False)")
        self.chunk, self.device = chunk, torch.device(device)
        self.slots = [
            (
                torch.empty(chunk, dtype=torch.uint8, pin_memory=True),
                torch.empty(chunk, dtype=torch.uint8, pin_memory=True),
                torch.empty(chunk, dtype=torch.uint8, device=self.device),
                torch.empty(chunk, dtype=torch.uint8, device=self.device),
                torch.cuda.Stream(self.device),
            )
            for _ in range(SLOTS)
        ]

    def cast(self, source: TensorStream, dst: str, out: int, progress: Callable[[int], None] = lambda n: None) -> int:
        """Cast the tensor that ``source`` reads to ``dst`` and append it to the fd ``out``.
        Returns how many finite values became infinite."""
        import torch

        ref = source.ref
        src = ref.dtype
        sdt, ddt = torch_dtype(src), torch_dtype(dst)
        si, di = ITEMSIZE[src], ITEMSIZE[dst]
        check = can_overflow(src, dst)
        # One counter per slot, each touched by its own stream only; the streams wait for
        # the zeroing, which runs on the default stream.
        counts = [torch.zeros((), dtype=torch.int64, device=self.device) for _ in self.slots]
        for *_, stream in self.slots:
            stream.wait_stream(torch.cuda.current_stream(self.device))

        def read(slot: int, start: int, k: int) -> None:  # steps come in order: a sequential read
            source.readinto(memoryview(self.slots[slot][0].numpy())[: k * si])

        def submit(slot: int, k: int) -> Event:
            host_in, host_out, dev_in, dev_out, stream = self.slots[slot]
            with torch.cuda.stream(stream):
                dev_in[: k * si].copy_(host_in[: k * si], non_blocking=True)
                a, b = dev_in[: k * si].view(sdt), dev_out[: k * di].view(ddt)
                b.copy_(a)
                if check:
                    counts[slot] += (torch.isinf(b) & ~torch.isinf(a)).sum()
                host_out[: k * di].copy_(dev_out[: k * di], non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            return event

        def write(slot: int, k: int) -> None:
            write_all(out, memoryview(self.slots[slot][1].numpy())[: k * di])
            progress(k * di)

        pipeline(chunk_steps(self.chunk, ref.numel, src, dst), len(self.slots), read, submit, write)
        torch.cuda.synchronize(self.device)
        return sum(int(c) for c in counts)
