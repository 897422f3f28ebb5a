"""Gathering a non-contiguous torch view into row-major bytes, one bounded block at a time."""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from typing import TYPE_CHECKING

from streamck.source.header import TensorRef

if TYPE_CHECKING:  # numpy is imported where a view is gathered, not by every rewrite
    import numpy as np


def strided_array(ref: TensorRef, mm: mmap.mmap) -> np.ndarray:
    """``ref`` as a read-only numpy view of the mapped file (elements as unsigned ints)."""
    import numpy as np

    item = (ref.end - ref.start) // max(1, _numel(ref.shape))
    span = 1 + sum((d - 1) * s for d, s in zip(ref.shape, ref.strides, strict=True))
    base = np.frombuffer(mm, dtype=np.dtype(f"<u{item}"), count=span, offset=ref.start)
    return np.lib.stride_tricks.as_strided(base, ref.shape, [s * item for s in ref.strides], writeable=False)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _blocks(view: np.ndarray, chunk: int) -> Iterator[np.ndarray]:
    import numpy as np

    if view.ndim == 0 or view.nbytes <= chunk:
        yield np.ascontiguousarray(view)
        return
    row = view[0].nbytes
    if row > chunk:
        for i in range(len(view)):
            yield from _blocks(view[i], chunk)
        return
    step = chunk // row
    for i in range(0, len(view), step):
        yield np.ascontiguousarray(view[i : i + step])


def gather(ref: TensorRef, chunk: int) -> Iterator[memoryview]:
    """The bytes of the strided tensor ``ref`` in row-major order, in blocks of about
    ``chunk`` bytes. Mapped pages are released after each block, so RSS stays bounded."""
    import numpy as np

    with open(ref.path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        view = strided_array(ref, mm)
        for block in _blocks(view, chunk):
            yield memoryview(block.reshape(-1).view(np.uint8))
            mm.madvise(mmap.MADV_DONTNEED)
        del view
    finally:
        try:
            mm.close()
        except BufferError:  # a caller still holds a block; the map goes with it
            pass
