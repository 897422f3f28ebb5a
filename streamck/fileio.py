"""Whole reads and writes on raw fds: the two loops every data path needs."""

from __future__ import annotations

import os

from streamck.errors import CheckpointError


def write_all(fd: int, data: memoryview | bytes) -> None:
    """os.write until every byte of ``data`` is written."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def read_into(fd: int, view: memoryview, offset: int, path: str) -> None:
    """Fill ``view`` from ``fd`` at ``offset``; a short file is a CheckpointError naming ``path``."""
    while view:
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise CheckpointError("file ended before its last tensor's bytes (truncated?)", path)
        view, offset = view[n:], offset + n
