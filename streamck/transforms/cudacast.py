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

from streamck.errors import DeviceError
from streamck.fileio import write_all
from streamck.source.reader import TensorStream
from streamck.transforms.cast import ITEMSIZE, can_overflow, chunk_steps, torch_dtype

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


def _device_error(device: str, e: BaseException) -> DeviceError:
    """A CUDA failure (no memory, a bad ordinal, a driver error) as one line."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return DeviceError(f"{{device}} {device}: {first}")


class CudaCaster:
    """``Caster.cast`` on a CUDA device: ``SLOTS`` sets of buffers of ``chunk`` bytes each.

    Everything (pinned buffers, streams, casts) is made and run with the caster's device
    current, so ``cuda:N`` never opens a context on GPU 0; the process's current device
    is left as it was. Each slot's counter lives on that slot's stream, and every way
    out of a cast waits for the slot streams, so no buffer goes back to the allocator
    with work still queued on it.
    """

    def __init__(self, chunk: int, device: str = "cuda"):
        import torch

        if not torch.cuda.is_available():
            raise DeviceError(f"{{device}} {device}: no usable CUDA device (torch.cuda.is_available() is False)")
        index = torch.device(device).index
        count = torch.cuda.device_count()
        if index is not None and index >= count:
            raise DeviceError(
                f"{{device}} {device}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
            )
        self.chunk, self.name = chunk, device
        self.device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
        try:
            with torch.cuda.device(self.device):
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
                self.host_counts = torch.zeros(SLOTS, dtype=torch.int64, pin_memory=True)
        except RuntimeError as e:  # torch.cuda.OutOfMemoryError and driver errors alike
            raise _device_error(device, e) from None

    def close(self) -> None:
        """Give back the pinned and device buffers, once no work is queued on them."""
        for *_, stream in self.slots:
            stream.synchronize()
        self.slots = []

    def cast(self, source: TensorStream, dst: str, out: int, progress: Callable[[int], None] = lambda n: None) -> int:
        """Cast the tensor that ``source`` reads to ``dst`` and append it to the fd ``out``.
        Returns how many finite values became infinite."""
        import torch

        try:
            with torch.cuda.device(self.device):
                try:
                    return self._cast(source, dst, out, progress)
                finally:  # on any error too: queued work must finish before the buffers are reused
                    for *_, stream in self.slots:
                        stream.synchronize()
        except RuntimeError as e:
            raise _device_error(self.name, e) from None

    def _cast(self, source: TensorStream, dst: str, out: int, progress: Callable[[int], None]) -> int:
        import torch

        ref = source.ref
        src = ref.dtype
        sdt, ddt = torch_dtype(src), torch_dtype(dst)
        si, di = ITEMSIZE[src], ITEMSIZE[dst]
        check = can_overflow(src, dst)
        counts = []
        for *_, stream in self.slots:  # each slot's counter is made and used on its own stream only
            with torch.cuda.stream(stream):
                counts.append(torch.zeros((), dtype=torch.int64, device=self.device))

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
        for i, (*_, stream) in enumerate(self.slots):  # counters read back once per tensor, into pinned memory
            with torch.cuda.stream(stream):
                self.host_counts[i].copy_(counts[i], non_blocking=True)
            stream.synchronize()
        return int(self.host_counts.sum())
