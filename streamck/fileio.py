"""Whole reads and writes on raw fds, and block sharing between files (FICLONERANGE)."""

from __future__ import annotations

import errno
import functools
import os
import struct

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


def fsync(path: str | os.PathLike) -> None:
    """fsync a file or a directory (its entries) by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


# <linux/fs.h>: _IOW(0x94, 13, struct file_clone_range {s64 src_fd; u64 src_offset, src_length, dest_offset;})
FICLONERANGE = 0x4020940D
# Errors that mean "these two files cannot share blocks" (rather than a failing disk).
NO_CLONE = {
    errno.EXDEV,
    errno.EOPNOTSUPP,
    errno.EINVAL,
    errno.ENOTTY,
    errno.ENOSYS,
    errno.EBADF,
    errno.EPERM,
    errno.ETXTBSY,
}


def clone_range(src: int, src_offset: int, dst: int, dst_offset: int, length: int) -> None:
    """Make ``dst``'s bytes ``[dst_offset, dst_offset + length)`` share the blocks holding
    ``src``'s ``[src_offset, src_offset + length)`` (Linux ``FICLONERANGE``): nothing is
    copied and no new block is used. Offsets and length must be multiples of the
    filesystem's block (the length may end at ``src``'s end). ``dst``'s file position does
    not move. Raises OSError, with an errno in NO_CLONE where these files cannot share."""
    import fcntl

    fcntl.ioctl(dst, FICLONERANGE, struct.pack("=qQQQ", src, src_offset, length, dst_offset))


def _scratch(directory: str | os.PathLike) -> int:
    """A new empty file in ``directory`` open for reading and writing, with no name (O_TMPFILE),
    or where the filesystem has none of those (NFS), one named as a streamck temporary and
    unlinked at once (streamck.writer.atomic: an output's checks pass over such a name)."""
    try:
        return os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
    except (OSError, AttributeError):
        pass
    path = os.path.join(directory, f".clone-probe.streamck-tmp-{os.getpid()}-{os.urandom(4).hex()}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.unlink(path)
    return fd


def can_clone(directory: str | os.PathLike, block: int) -> bool:
    """Whether files in ``directory`` can share blocks: one ``block`` cloned between two
    scratch files there (nothing is left behind). False on any error."""
    fds: list[int] = []
    try:
        fds.append(_scratch(directory))
        fds.append(_scratch(directory))
        write_all(fds[0], b"\0" * block)
        clone_range(fds[0], 0, fds[1], 0, block)
        return True
    except OSError:
        return False
    finally:
        for fd in fds:
            os.close(fd)
