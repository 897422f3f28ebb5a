"""Whole reads and writes on raw fds: the two loops every data path needs."""

from __future__ import annotations

import os

from streamck.errors import CheckpointError

# One write() call never carries more than this. Linux 6.x ext4 builds page-cache folios
# as large as the write; on a VM whose free memory goes back to the host, those
# high-order allocations made writes of >= 512 KiB ten times slower than 256 KiB pieces
# (bench/RESULTS.md). Elsewhere 4,096 calls per GiB cost a few milliseconds.
WRITE_PIECE = 256 << 10


def write_all(fd: int, data: memoryview | bytes) -> None:
    """os.write until every byte of ``data`` is written, in WRITE_PIECE calls."""
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view[:WRITE_PIECE]) :]


def read_into(fd: int, view: memoryview, offset: int, path: str) -> None:
    """Fill ``view`` from ``fd`` at ``offset``; a short file is a CheckpointError naming ``path``."""
    while view:
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise CheckpointError("file ended before its last tensor's bytes (truncated?)", path)
        view, offset = view[n:], offset + n
