"""Moving unchanged tensor bytes between files, one bounded chunk at a time.

The kernel does the copying where it can (``copy_file_range``, then
``sendfile``), so the bytes never enter this process; otherwise one reused
buffer of ``chunk`` bytes carries them.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable

from streamck.errors import CheckpointError
from streamck.fileio import read_into, write_all

CHUNK = 64 << 20
# Errors that mean "this way of copying does not work between these two files".
_FALLBACK = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF, errno.ESPIPE}
# Kernel-side copies, appending at dst's position: (src, dst, count, src offset) -> bytes copied.
_KERNEL = {
    "copy_file_range": lambda src, dst, count, offset: os.copy_file_range(src, dst, count, offset),
    "sendfile": lambda src, dst, count, offset: os.sendfile(dst, src, offset, count),
}


class Copier:
    """Copies byte ranges from source fds to the current position of a destination fd."""

    MODES = ("copy_file_range", "sendfile", "buffer")

    def __init__(self, chunk: int = CHUNK, mode: str | None = None):
        self.chunk = chunk
        self._mode = mode or next(m for m in self.MODES if m == "buffer" or hasattr(os, m))
        self._buffer: bytearray | None = None

    def copy(
        self, src: int, offset: int, count: int, dst: int, path: str, progress: Callable[[int], None] = lambda n: None
    ) -> None:
        """Append ``count`` bytes of ``src`` from ``offset`` to ``dst``, reporting each chunk."""
        end = offset + count
        while offset < end:
            n = self._step(src, offset, min(self.chunk, end - offset), dst, path)
            offset += n
            progress(n)

    def _step(self, src: int, offset: int, count: int, dst: int, path: str) -> int:
        while self._mode != "buffer":
            try:
                n = _KERNEL[self._mode](src, dst, count, offset)
                break
            except OSError as e:
                if e.errno not in _FALLBACK:
                    raise
                self._mode = self.MODES[self.MODES.index(self._mode) + 1]  # not here: try the next way
        else:
            if self._buffer is None:
                self._buffer = bytearray(self.chunk)
            view = memoryview(self._buffer)[:count]
            read_into(src, view, offset, path)
            write_all(dst, view)
            n = count
        if n == 0:
            raise CheckpointError("file ended before its last tensor's bytes (truncated?)", path)
        return n
