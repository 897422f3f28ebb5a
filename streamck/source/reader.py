"""Reading a tensor's bytes in bounded chunks through one reused buffer."""

from __future__ import annotations

import os
from collections.abc import Iterator

from streamck.fileio import read_into
from streamck.source.header import TensorRef
from streamck.source.strided import gather

READ_CHUNK = 16 << 20


class ChunkReader:
    """Yields a tensor's bytes as views of one buffer of ``chunk`` bytes (each view is
    valid until the next one); keeps one fd per file open until closed."""

    def __init__(self, chunk: int = READ_CHUNK):
        self.chunk = chunk
        self._buffer = bytearray(chunk)
        self._fds: dict[str, int] = {}

    def chunks(self, ref: TensorRef, step: int | None = None) -> Iterator[memoryview]:
        """The bytes of ``ref`` in pieces of ``step`` bytes (at most the chunk size; a
        non-contiguous torch view comes in gathered blocks of about that size)."""
        if ref.strides is not None:
            yield from gather(ref, step or self.chunk)
            return
        path = os.fspath(ref.path)
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        step = min(step or self.chunk, self.chunk)
        view = memoryview(self._buffer)
        for offset in range(ref.start, ref.end, step):
            n = min(step, ref.end - offset)
            read_into(fd, view[:n], offset, path)
            yield view[:n]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> ChunkReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
