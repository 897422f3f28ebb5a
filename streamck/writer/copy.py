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
_FALLBACK = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF, errno.ESPIPE}


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
        if self._mode == "copy_file_range":
            try:
                n = os.copy_file_range(src, dst, count, offset)
            except OSError as e:
                if e.errno not in _FALLBACK:
                    raise
                self._mode = "sendfile"
                return self._step(src, offset, count, dst, path)
        elif self._mode == "sendfile":
            try:
                n = os.sendfile(dst, src, offset, count)
            except OSError as e:
                if e.errno not in _FALLBACK:
                    raise
                self._mode = "buffer"
                return self._step(src, offset, count, dst, path)
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
