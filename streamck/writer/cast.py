"""Casting tensor bytes chunk by chunk into reused buffers, on the CPU (CUDA: cudacast).

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


def torch_dtype(name: str):
    import torch

    return {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[name]


def chunk_steps(chunk: int, numel: int, src: str, dst: str) -> list[tuple[int, int]]:
    """``(first element, count)`` of each step casting ``numel`` elements within ``chunk`` bytes."""
    per = chunk // max(ITEMSIZE[src], ITEMSIZE[dst])
    if per >= 4096:  # whole vectors per chunk: torch's scalar tail loop runs only at the end
        per -= per % 4096
    return [(i, min(per, numel - i)) for i in range(0, numel, per)]


def new_caster(chunk: int = CAST_CHUNK, device: str = "cpu"):
    """A ``Caster`` for ``device`` "cpu", a ``CudaCaster`` for "cuda" or "cuda:N"."""
    if device == "cpu":
        return Caster(chunk)
    if device.split(":")[0] == "cuda":
        from streamck.writer.cudacast import CudaCaster

        return CudaCaster(chunk, device)
    raise StreamckError(f"--device {device}: only cpu and cuda are supported")


class Caster:
    """Casts a range of source bytes on the CPU and appends the result to a destination fd.

    Holds one input and one output buffer of about ``chunk`` bytes each, reused for
    every tensor.
    """

    def __init__(self, chunk: int = CAST_CHUNK):
        import torch

        self.chunk = chunk
        self.host_in = torch.empty(chunk, dtype=torch.uint8)
        self.host_out = torch.empty(chunk, dtype=torch.uint8)

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
        overflow = 0
        for view, inf in self.convert(fd, offset, numel, src, dst, path):
            write_all(out, view)
            progress(len(view))
            overflow += inf
        return overflow

    def convert(
        self, fd: int, offset: int, numel: int, src: str, dst: str, path: str
    ) -> Iterator[tuple[memoryview, int]]:
        """Step by step: (output bytes, finite values that became infinite). Each view is
        valid until the next step."""
        sdt, ddt = torch_dtype(src), torch_dtype(dst)
        si, di = ITEMSIZE[src], ITEMSIZE[dst]
        check = can_overflow(src, dst)
        for start, k in chunk_steps(self.chunk, numel, src, dst):
            read_into(fd, memoryview(self.host_in.numpy())[: k * si], offset + start * si, path)
            a = self.host_in[: k * si].view(sdt)
            b = self.host_out[: k * di].view(ddt)
            b.copy_(a)
            inf = _new_infinities(a, b, dst) if check else 0
            yield memoryview(self.host_out.numpy())[: k * di], inf
