"""Local files as ByteSources: one read-only fd, whole ``preadv`` reads."""

from __future__ import annotations

import os
import stat

from streamck.fileio import read_into


class FdSource:
    """Whole reads at an offset of an fd its owner keeps open (a reader's pool) and closes."""

    def __init__(self, fd: int, path: os.PathLike):
        self.fd, self.path = fd, path

    def readinto(self, view: memoryview, offset: int) -> None:
        read_into(self.fd, view, offset, os.fspath(self.path))


class LocalSource:
    """The file at ``path`` open read-only; OSError (IsADirectoryError for a folder) if it cannot be."""

    def __init__(self, path: os.PathLike):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        st = os.fstat(self.fd)
        if stat.S_ISDIR(st.st_mode):
            os.close(self.fd)
            raise IsADirectoryError(21, "Is a directory", os.fspath(path))
        self.size = st.st_size

    def readinto(self, view: memoryview, offset: int) -> None:
        read_into(self.fd, view, offset, os.fspath(self.path))

    def close(self) -> None:
        os.close(self.fd)
