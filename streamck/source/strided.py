"""Gathering a non-contiguous torch view into row-major bytes, one bounded block at a time.

Blocks are read with ``pread`` into a bounded scratch buffer, never through a
mapping: each row of a transposed matrix touches every page of its storage, and
mapped pages (with the kernel's fault-around, whole 64 KiB windows) would all
count as resident, up to the whole tensor.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from streamck.fileio import read_into
from streamck.source.header import TensorRef

if TYPE_CHECKING:  # numpy is imported where a view is gathered, not by every rewrite
    import numpy as np

    from streamck.storage.remote import RemoteSource


def _itemsize(ref: TensorRef) -> int:
    return (ref.end - ref.start) // max(1, math.prod(ref.shape))


def _span(shape: tuple[int, ...], strides) -> int:
    """Elements from the first to the last that a box touches (torch strides are >= 0)."""
    return 1 + sum((e - 1) * s for e, s in zip(shape, strides, strict=True))


def _boxes(shape: tuple[int, ...], strides: tuple[int, ...], limit: int, offset: int = 0) -> Iterator[tuple]:
    """(offset, shape) of boxes of at most ``limit`` elements that tile the view in
    row-major order; shapes keep the view's rank."""
    if not shape or math.prod(shape) <= limit:
        yield offset, shape
        return
    row = math.prod(shape[1:])
    if row > limit:
        for i in range(shape[0]):
            for off, sub in _boxes(shape[1:], strides[1:], limit, offset + i * strides[0]):
                yield off, (1, *sub)
        return
    step = limit // row
    for i in range(0, shape[0], step):
        yield offset + i * strides[0], (min(step, shape[0] - i), *shape[1:])


class _Gatherer:
    """Fills boxes of one strided view from its file, through one scratch buffer.

    A box whose span in the file fits the buffer is read in one piece. Otherwise it is
    cut along its largest stride into slices; when those fit (a transposed matrix: one
    run of each source row) as many as fit are read back to back and placed with one
    numpy copy, else each slice is filled the same way.
    """

    def __init__(self, ref: TensorRef, src: int | RemoteSource, limit: int):
        import numpy as np

        self.ref, self.src, self.item = ref, src, _itemsize(ref)
        if not isinstance(src, int):  # a remote file: whole reads at an offset
            self._read = self._read_source
        self.scratch = np.empty(2 * limit, np.dtype(f"<u{self.item}"))  # spans of 2x a box read at once
        self.raw, self.path = memoryview(self.scratch).cast("B"), str(ref.path)

    def _read(self, offset: int, count: int, at: int = 0) -> None:
        # Called once per run of a transposed matrix (a million times per GiB): one syscall.
        view = self.raw[at * self.item : (at + count) * self.item]
        pos = self.ref.start + offset * self.item
        if os.preadv(self.src, [view], pos) != len(view):
            read_into(self.src, view, pos, self.path)  # a short read: finish it, or say why

    def _read_source(self, offset: int, count: int, at: int = 0) -> None:
        self.src.readinto(self.raw[at * self.item : (at + count) * self.item], self.ref.start + offset * self.item)

    def _strided(self, shape: tuple[int, ...], strides) -> np.ndarray:
        from numpy.lib.stride_tricks import as_strided

        return as_strided(self.scratch, shape, [s * self.item for s in strides], writeable=False)

    def fill(self, out: np.ndarray, offset: int, strides: tuple[int, ...]) -> None:
        """Fill ``out`` with the elements at ``offset + sum(index * strides)``."""
        import numpy as np

        shape = out.shape
        if out.size == 0:
            return
        span = _span(shape, strides)
        if span <= len(self.scratch):
            self._read(offset, span)
            out[...] = self._strided(shape, strides)
            return
        d = max((k for k in range(len(shape)) if shape[k] > 1), key=lambda k: strides[k])
        rest, rest_strides = shape[:d] + shape[d + 1 :], strides[:d] + strides[d + 1 :]
        slices = np.moveaxis(out, d, 0)  # slices[i]: index i along d
        run = _span(rest, rest_strides)
        if run > len(self.scratch):
            for i in range(shape[d]):
                self.fill(slices[i], offset + i * strides[d], rest_strides)
            return
        per = len(self.scratch) // run
        for first in range(0, shape[d], per):
            n = min(per, shape[d] - first)
            if isinstance(self.src, int):
                for i in range(n):
                    self._read(offset + (first + i) * strides[d], run, at=i * run)
            else:  # a remote file: the batch's runs as a few joined requests, not one each
                size, base = run * self.item, self.ref.start + offset * self.item
                step = strides[d] * self.item
                self.src.fill([(base + (first + i) * step, self.raw[i * size : (i + 1) * size]) for i in range(n)])
            slices[first : first + n] = self._strided((n, *rest), (run, *rest_strides))


def gather(ref: TensorRef, chunk: int, fd: int | RemoteSource) -> Iterator[memoryview]:
    """The bytes of the strided tensor ``ref``, read through ``fd`` (open on its file, or a
    remote file's ByteSource), in
    row-major order, in blocks of at most ``chunk`` bytes (or one element); memory is
    about three blocks."""
    import numpy as np

    limit = max(1, chunk // _itemsize(ref))
    gatherer = _Gatherer(ref, fd, limit)
    for offset, shape in _boxes(ref.shape, ref.strides, limit):
        out = np.empty(shape, gatherer.scratch.dtype)
        gatherer.fill(out, offset, ref.strides)
        yield memoryview(out.reshape(-1).view(np.uint8))
