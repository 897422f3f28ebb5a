"""Whole reads and writes on raw fds: the two loops every data path needs."""

from __future__ import annotations

import functools
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


_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of the range's dirty pages, do not wait


@functools.cache
def _sync_file_range():
    try:
        import ctypes

        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return call


def start_writeback(fd: int, offset: int, length: int) -> bool:
    """Have the kernel start writing ``fd``'s dirty pages in ``[offset, offset + length)``
    to disk, and return at once (Linux ``sync_file_range``). False where that cannot be
    done: another system, or an fd that is no regular file."""
    call = _sync_file_range()
    return call is not None and call(fd, offset, length, _SYNC_FILE_RANGE_WRITE) == 0
