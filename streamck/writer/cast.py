"""Casting tensor bytes chunk by chunk into reused buffers, on the CPU or a CUDA device.

torch does the arithmetic, so every cast gives exactly the bits of
``Tensor.to(dtype)`` on the CPU; it is imported only when a plan casts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from streamck.dtypes import BITS, CASTABLE
from streamck.errors import StreamckError
from streamck.fileio import read_into, write_all

# Source bytes per cast step. Smaller than the copy chunk: these pages live in this
# process (input, output and two flag temporaries), on top of torch's ~200 MiB.
CAST_CHUNK = 16 << 20

ITEMSIZE = {name: BITS[name] // 8 for name in CASTABLE}
# Largest finite value of each castable dtype, to know which casts can overflow.
_RANGE = {"F64": 1.8e308, "F32": 3.4028234664e38, "BF16": 3.3895313892e38, "F16": 65504.0}


def can_overflow(src: str, dst: str) -> bool:
    """Whether casting ``src`` to ``dst`` can turn a finite value into infinity."""
    return _RANGE[dst] < _RANGE[src]


def _new_infinities(a, b, dst: str) -> int:
    """Finite values of ``a`` that became infinite in ``b``. Counting is slow (~10 ms per
    4M elements here) and almost never needed: one min/max pass rules it out first."""
    import torch

    lo, hi = torch.aminmax(a)
    if max(-float(lo), float(hi)) <= _RANGE[dst]:  # False for NaN or inf: then count
        return 0
    return int((torch.isinf(b) & ~torch.isinf(a)).sum())


def _torch_dtype(name: str):
    import torch

    return {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[name]


class Caster:
    """Casts a range of source bytes and appends the result to a destination fd.

    Holds one input and one output buffer of about ``chunk`` bytes each (per
    pipeline slot on CUDA), reused for every tensor.
    """

    def __init__(self, chunk: int = CAST_CHUNK, device: str = "cpu"):
        import torch

        self.chunk = chunk
        self.device = torch.device(device)
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise StreamckError("--device cuda: no usable CUDA device (torch.cuda.is_available() is False)")
            self._slots = [self._buffers(pin=True) for _ in range(2)]
            self._streams = [torch.cuda.Stream(self.device) for _ in range(2)]
        elif self.device.type == "cpu":
            self._slots = [self._buffers(pin=False)]
        else:
            raise StreamckError(f"--device {device}: only cpu and cuda are supported")

    def _buffers(self, pin: bool):
        import torch

        host_in = torch.empty(self.chunk, dtype=torch.uint8, pin_memory=pin)
        host_out = torch.empty(self.chunk, dtype=torch.uint8, pin_memory=pin)
        if not pin:
            return host_in, host_out, None, None
        dev_in = torch.empty(self.chunk, dtype=torch.uint8, device=self.device)
        dev_out = torch.empty(self.chunk, dtype=torch.uint8, device=self.device)
        return host_in, host_out, dev_in, dev_out

    def _steps(self, numel: int, src: str, dst: str) -> list[tuple[int, int]]:
        per = self.chunk // max(ITEMSIZE[src], ITEMSIZE[dst])
        if per >= 4096:  # whole vectors per chunk: torch's scalar tail loop runs only at the end
            per -= per % 4096
        return [(i, min(per, numel - i)) for i in range(0, numel, per)]

    def cast(
        self,
        fd: int,
        offset: int,
        numel: int,
        src: str,
        dst: str,
        out: int,
        path: str,
        progress: Callable[[int], None] = lambda n: None,
    ) -> int:
        """Cast ``numel`` elements of ``src`` read from ``fd`` at ``offset``; append them as
        ``dst`` to ``out``. Returns how many finite values became infinite."""
        if self.device.type == "cuda":
            return self._cast_cuda(fd, offset, numel, src, dst, out, path, progress)
        overflow = 0
        for view, inf in self.convert(fd, offset, numel, src, dst, path):
            write_all(out, view)
            progress(len(view))
            overflow += inf
        return overflow

    def convert(
        self, fd: int, offset: int, numel: int, src: str, dst: str, path: str
    ) -> Iterator[tuple[memoryview, int]]:
        """On the CPU, step by step: (output bytes, finite values that became infinite).
        Each view is valid until the next step."""

        host_in, host_out, _, _ = self._slots[0]
        sdt, ddt = _torch_dtype(src), _torch_dtype(dst)
        si, di = ITEMSIZE[src], ITEMSIZE[dst]
        check = can_overflow(src, dst)
        for start, k in self._steps(numel, src, dst):
            read_into(fd, memoryview(host_in.numpy())[: k * si], offset + start * si, path)
            a = host_in[: k * si].view(sdt)
            b = host_out[: k * di].view(ddt)
            b.copy_(a)
            inf = _new_infinities(a, b, dst) if check else 0
            yield memoryview(host_out.numpy())[: k * di], inf

    def _cast_cuda(self, fd, offset, numel, src, dst, out, path, progress) -> int:
        # Two slots: while the GPU moves and casts chunk i, the host writes chunk i-1
        # and reads chunk i+1, so disk and PCIe stay busy.
        import torch

        sdt, ddt = _torch_dtype(src), _torch_dtype(dst)
        si, di = ITEMSIZE[src], ITEMSIZE[dst]
        check = can_overflow(src, dst)
        # One counter per slot: each is touched by its own stream only.
        overflow = [torch.zeros((), dtype=torch.int64, device=self.device) for _ in range(2)]
        for stream in self._streams:  # the zeroing above runs on the default stream: order after it
            stream.wait_stream(torch.cuda.current_stream(self.device))
        pending: list[tuple[int, int, torch.cuda.Event]] = []

        def drain() -> None:
            slot, k, event = pending.pop(0)
            event.synchronize()
            write_all(out, memoryview(self._slots[slot][1].numpy())[: k * di])
            progress(k * di)

        for i, (start, k) in enumerate(self._steps(numel, src, dst)):
            slot = i % 2
            if len(pending) == 2:
                drain()
            host_in, host_out, dev_in, dev_out = self._slots[slot]
            read_into(fd, memoryview(host_in.numpy())[: k * si], offset + start * si, path)
            stream = self._streams[slot]
            with torch.cuda.stream(stream):
                dev_in[: k * si].copy_(host_in[: k * si], non_blocking=True)
                a = dev_in[: k * si].view(sdt)
                b = dev_out[: k * di].view(ddt)
                b.copy_(a)
                if check:
                    overflow[slot] += (torch.isinf(b) & ~torch.isinf(a)).sum()
                host_out[: k * di].copy_(dev_out[: k * di], non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            pending.append((slot, k, event))
        while pending:
            drain()
        torch.cuda.synchronize(self.device)
        return int(sum(int(o) for o in overflow))
