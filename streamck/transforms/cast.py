"""Casting tensor bytes chunk by chunk into reused buffers, on the CPU (CUDA: cudacast).

The arithmetic is numpy's (streamck.transforms.npcast), made to give exactly the bits of
torch's CPU ``Tensor.to(dtype)``; torch is not imported here (only ``torch_dtype``,
for the CUDA caster and ``--verify``, needs it). A reader thread fills the next input
buffer while the current one is converted and written.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from streamck.dtypes import BITS, CASTABLE, TORCH_NAMES
from streamck.fileio import write_all
from streamck.source.reader import CHUNK, TensorStream
from streamck.transforms.npcast import Converter
from streamck.transforms.npcast import can_overflow as can_overflow

# Source bytes per cast step of the CUDA caster (the reader's buffer size). The CPU caster
# caps its own steps at CPU_STEP: it holds two inputs and an output, and 4 MiB steps
# already keep a pipeline of read, convert and write busy.
CAST_CHUNK = CHUNK
CPU_STEP = 4 << 20

ITEMSIZE = {name: BITS[name] // 8 for name in CASTABLE}


def torch_dtype(name: str):
    """The torch dtype of a castable safetensors dtype name (imports torch)."""
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

    Holds two input buffers and one output buffer of at most ``chunk`` bytes each (and
    ``CPU_STEP``), reused for every tensor, and one reader thread, started for the first
    tensor that takes more than one step. A tensor's stream is only ever read by that
    thread while its steps run, one read at a time, in order.
    """

    def __init__(self, chunk: int = CAST_CHUNK):
        self.chunk = max(min(chunk, CPU_STEP), max(ITEMSIZE.values()))
        self.host_in = [np.empty(self.chunk, np.uint8) for _ in range(2)]
        self.host_out = np.empty(self.chunk, np.uint8)
        self.converter = Converter()
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None  # the read of the next step, under way

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
        until the next step. The next step's input is read meanwhile."""
        src = stream.ref.dtype
        si, di = ITEMSIZE[src], ITEMSIZE[dst]
        steps = [k for _, k in chunk_steps(self.chunk, stream.ref.numel, src, dst)]

        def read(i: int) -> None:
            stream.readinto(memoryview(self.host_in[i % 2])[: steps[i] * si])

        self._settle()  # an earlier tensor's generator left unfinished and not yet collected
        mine: Future | None = None
        try:
            for i, k in enumerate(steps):
                if mine is None:
                    read(i)
                else:
                    mine.result()
                    mine = self._pending = None
                if i + 1 < len(steps):  # the other buffer: its step was converted already
                    mine = self._pending = self._reader().submit(read, i + 1)
                inp, out = self.host_in[i % 2][: k * si], self.host_out[: k * di]
                inf = self.converter.convert(src, dst, inp, out)
                yield memoryview(out), inf
        finally:  # abandoned or failed: no read of ours may still be filling a buffer afterwards
            if mine is not None and self._pending is mine:
                self._settle()

    def _settle(self) -> None:
        """Wait for (or cancel) the read under way, if any; its error no longer matters."""
        if self._pending is not None:
            future, self._pending = self._pending, None
            future.cancel() or future.exception()

    def close(self) -> None:
        """Stop the read-ahead thread (started on the first tensor longer than one step)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _reader(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamck-cast-read")
        return self._pool
