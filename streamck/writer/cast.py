"""Casting tensor bytes chunk by chunk into reused buffers, on the CPU (CUDA: cudacast).

torch does the arithmetic, so every cast gives exactly the bits of
``Tensor.to(dtype)`` on the CPU; it is imported only when a plan casts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from streamck.dtypes import BITS, CASTABLE, TORCH_NAMES
from streamck.fileio import write_all
from streamck.source.reader import CHUNK, TensorStream

# Source bytes per cast step: the reader's buffer size. These pages live in this
# process (input, output and two flag temporaries), on top of torch's ~200 MiB.
CAST_CHUNK = CHUNK

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
    """The torch dtype of a castable safetensors dtype name."""
    import torch

    return getattr(torch, TORCH_NAMES[name])


def chunk_steps(chunk: int, numel: int, src: str, dst: str) -> list[tuple[int, int]]:
    """``(first element, count)`` of each step casting ``numel`` elements within ``chunk`` bytes."""
    per = chunk // max(ITEMSIZE[src], ITEMSIZE[dst])
    if per >= 4096:  # whole vectors per chunk: torch's scalar tail loop runs only at the end
        per -= per % 4096
    return [(i, min(per, numel - i)) for i in range(0, numel, per)]


class Caster:
    """Casts tensors on the CPU and appends the result to a destination fd.

    Holds one input and one output buffer of about ``chunk`` bytes each, reused for
    every tensor.
    """

    def __init__(self, chunk: int = CAST_CHUNK):
        import torch

        self.chunk = chunk
        self.host_in = torch.empty(chunk, dtype=torch.uint8)
        self.host_out = torch.empty(chunk, dtype=torch.uint8)

    def cast(self, stream: TensorStream, dst: str, out: int, progress: Callable[[int], None] = lambda n: None) -> int:
        """Cast the tensor that ``stream`` reads to ``dst`` and append it to the fd ``out``.
        Returns how many finite values became infinite."""
        overflow = 0
        for view, inf in self.convert(stream, dst):
            write_all(out, view)
            progress(len(view))
            overflow += inf
        return overflow

    def convert(self, stream: TensorStream, dst: str) -> Iterator[tuple[memoryview, int]]:
        """Step by step: (output bytes, finite values that became infinite), each view valid
        until the next step."""
        src, inp = stream.ref.dtype, memoryview(self.host_in.numpy())
        si = ITEMSIZE[src]
        for _, k in chunk_steps(self.chunk, stream.ref.numel, src, dst):
            stream.readinto(inp[: k * si])
            yield self._step(k, src, dst)

    def _step(self, k: int, src: str, dst: str) -> tuple[memoryview, int]:
        """Cast the first ``k`` elements of the input buffer into the output buffer."""
        di = ITEMSIZE[dst]
        a = self.host_in[: k * ITEMSIZE[src]].view(torch_dtype(src))
        b = self.host_out[: k * di].view(torch_dtype(dst))
        b.copy_(a)
        inf = _new_infinities(a, b, dst) if can_overflow(src, dst) else 0
        return memoryview(self.host_out.numpy())[: k * di], inf
