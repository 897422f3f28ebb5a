"""A range of a file's bytes as a seekable raw file, for the readers that want a file object
(zipfile on a torch archive, or on one DCP blob inside a rank file)."""

from __future__ import annotations

import io
from typing import Protocol


class _Readable(Protocol):  # streamck.storage.ByteSource's reads (that package imports this module)
    def readinto(self, view: memoryview, offset: int) -> None: ...

    def close(self) -> None: ...


class Window(io.RawIOBase):
    """Bytes ``[base, base + length)`` of ``source`` as a raw seekable file: each read is one
    ``source.readinto`` (a pread, or a ranged GET); an io.BufferedReader in front joins the
    small reads of a zip directory or a pickle into a few."""

    def __init__(self, source: _Readable, base: int, length: int, owned: bool = False):
        super().__init__()
        self.source, self.base, self.length, self.pos, self.owned = source, base, length, 0, owned

    def close(self) -> None:
        """Close the window, and its source when the window owns it (open_file's)."""
        if not self.closed and self.owned:
            self.source.close()
        super().close()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = max(0, (0, self.pos, self.length)[whence] + offset)
        return self.pos

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")[: max(0, self.length - self.pos)]
        if len(view):
            self.source.readinto(view, self.base + self.pos)
        self.pos += len(view)
        return len(view)
