"""The one way streamck reads tensor bytes: runs turned into kernel copies or buffer fills.

Every consumer (the writer's copy and casts, ``--verify``, ``diff --data``, ``hash``,
``Checkpoint.read``) reads through a ``Reader``: one pool of read-only fds, and
streams that deliver a tensor's row-major bytes in whatever window sizes the
consumer asks for, independent of where the tensor's runs end. Runs that
continue one another in a file (a block's rows, interleaved with another
block's) are filled with one ``preadv`` each; long runs copied to a file never
enter this process. A strided torch view is gathered block by block
(streamck.source.strided). Memory is the consumer's window, never a whole
tensor or a mapping of its storage.
"""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from streamck.dtypes import BITS
from streamck.errors import CheckpointError
from streamck.fileio import read_into, write_all
from streamck.source.header import TensorRef
from streamck.source.runs import RowBlocks, Run
from streamck.storage import UrlPath

if TYPE_CHECKING:
    from streamck.storage.remote import RemoteSource

# Bytes per buffer fill: a cast step, a comparison window, a digest update.
CHUNK = 16 << 20
# Bytes per kernel-side copy call; never enter this process, so they can be larger.
COPY_CHUNK = 64 << 20
# A run at least this long is copied kernel-side; shorter ones go through the buffer.
KERNEL_MIN = 1 << 20
MAX_FDS = 256


def pool_size() -> int:
    """How many fds a Reader keeps open: MAX_FDS, or a quarter of the process's soft
    descriptor limit when that is lower (``ulimit -n 256``), leaving the rest to the
    writer, the caller and the interpreter."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return MAX_FDS
    return MAX_FDS if soft == resource.RLIM_INFINITY else min(MAX_FDS, max(4, soft // 4))


# Bytes of one block's rows read at once before they are placed in a window.
SCRATCH = 4 << 20
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
# Errors that mean "this way of copying does not work between these two files".
_FALLBACK = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF, errno.ESPIPE}
_KERNEL = {
    "copy_file_range": lambda src, dst, count, offset: os.copy_file_range(src, dst, count, offset),
    "sendfile": lambda src, dst, count, offset: os.sendfile(dst, src, offset, count),
}
COPY_MODES = ("copy_file_range", "sendfile", "buffer")


class Reader:
    """Reads tensors through one pool of fds, kept open until ``close``.

    ``chunk`` sizes the buffer that short runs and gathered blocks are copied
    through, ``copy_chunk`` each kernel-side copy; ``copy_mode`` forces one way of
    copying (tests), else the first that works between the two files is used.
    """

    def __init__(self, chunk: int = CHUNK, copy_mode: str | None = None, copy_chunk: int = COPY_CHUNK):
        self.chunk, self.copy_chunk = chunk, copy_chunk
        self._fds: dict[Path, int] = {}
        self._remote: dict[UrlPath, RemoteSource] = {}  # remote files' sources (streamck.storage)
        self._max_fds = pool_size()
        self._buffer: mmap.mmap | None = None
        self._spare = bytearray()
        self._mode = copy_mode or next(m for m in COPY_MODES if m == "buffer" or hasattr(os, m))

    def fd(self, path: Path) -> int:
        """A read-only fd on ``path``, from the pool: at most pool_size() stay open, the least
        recently used closed first (a ZeRO or DCP checkpoint may have thousands of files)."""
        if isinstance(path, UrlPath):
            raise TypeError(f"{path}: a URL has no fd; read it through Reader.remote")
        fd = self._fds.pop(path, None)
        if fd is None:
            if len(self._fds) >= self._max_fds:
                os.close(self._fds.pop(next(iter(self._fds))))
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise CheckpointError(f"cannot read: {e.strerror}", path) from None
        self._fds[path] = fd  # re-inserted: dicts keep insertion order, the oldest comes first
        return fd

    def read_at(self, path: Path, view: memoryview, offset: int) -> None:
        """Fill ``view`` with the bytes of ``path`` at ``offset``, or raise CheckpointError."""
        if isinstance(path, UrlPath):
            self.remote(path).readinto(view, offset)
        else:
            read_into(self.fd(path), view, offset, str(path))

    def remote(self, path: UrlPath) -> RemoteSource:
        """The source of the remote file ``path``, opened on first use and kept until ``close``."""
        src = self._remote.get(path)
        if src is None:
            from streamck.storage.remote import RemoteSource

            src = self._remote[path] = RemoteSource.open(path)
        return src

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        for src in self._remote.values():
            src.close()
        self._remote.clear()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stream(self, ref: TensorRef) -> TensorStream:
        """A sequential reader of ``ref``'s row-major bytes."""
        return TensorStream(self, ref)

    def windows(self, ref: TensorRef, size: int | None = None) -> Iterator[memoryview]:
        """``ref``'s bytes in consecutive windows of exactly ``size`` bytes (the last one
        shorter), each a view of this reader's buffer, valid until the next."""
        size = min(size or self.chunk, self.chunk)
        view = memoryview(self._scratch())[:size]
        stream = self.stream(ref)
        while n := stream.readinto(view):
            yield view[:n]

    def read(self, ref: TensorRef) -> bytes:
        """All of ``ref``'s bytes in one buffer of its size."""
        data = bytearray(ref.nbytes)
        self.stream(ref).readinto(memoryview(data))
        return bytes(data)

    def copy(self, ref: TensorRef, out: int, progress: Callable[[int], None] = lambda n: None) -> None:
        """Append ``ref``'s bytes to the fd ``out``: long runs kernel-side, the rest
        through the buffer; views and blocks narrower than a row are gathered; a tensor
        of parts is its parts in order."""
        if ref.parts is not None:
            for part in ref.parts:
                self.copy(part, out, progress)
            return
        if ref.strides is not None or _row_blocks(ref) is not None:  # gathered, not copied
            for view in self.windows(ref):
                write_all(out, view)
                progress(len(view))
            return
        # Runs shorter than a chunk are gathered in the buffer (made on first need: a plain
        # tensor never touches it), longer ones are copied by the kernel.
        filler, used, buffer = _Filler(self), 0, memoryview(b"")

        def flush() -> None:
            filler.flush()
            write_all(out, buffer[:used])
            progress(used)

        for run in ref.runs():
            if run.length > self.chunk or run.length >= KERNEL_MIN:
                if used:
                    flush()
                    used = 0
                self._copy_run(run, out, progress)
                continue
            if not buffer:
                buffer = memoryview(self._scratch())
            if used + run.length > len(buffer):
                flush()
                used = 0
            filler.add(run, buffer[used : used + run.length])
            used += run.length
        if used:
            flush()

    def _scratch(self) -> mmap.mmap:
        if self._buffer is None:
            # An anonymous mapping rather than a bytearray (which is zero-filled): a page
            # costs memory only once written, so gathering a few small tensors does not make
            # the whole chunk resident.
            self._buffer = mmap.mmap(-1, self.chunk, flags=mmap.MAP_PRIVATE)
        return self._buffer

    def scratch(self, n: int) -> memoryview:
        """``n`` bytes of a second reused buffer, for reads placed elsewhere."""
        if len(self._spare) < n:
            self._spare = bytearray(n)
        return memoryview(self._spare)[:n]

    def _copy_run(self, run: Run, out: int, progress: Callable[[int], None]) -> None:
        if isinstance(run.path, UrlPath):  # ranged requests, a few ahead, each piece written as it comes
            for data in self.remote(run.path).pieces(run.offset, run.length):
                write_all(out, data)
                progress(len(data))
            return
        src, offset, end = self.fd(run.path), run.offset, run.offset + run.length
        while offset < end:
            count = min(self.copy_chunk, end - offset)
            while self._mode != "buffer":
                try:
                    n = _KERNEL[self._mode](src, out, count, offset)
                    break
                except OSError as e:
                    if e.errno not in _FALLBACK:
                        raise
                    self._mode = COPY_MODES[COPY_MODES.index(self._mode) + 1]  # not here: try the next way
            else:
                view = memoryview(self._scratch())[: min(count, self.chunk)]
                read_into(src, view, offset, str(run.path))
                write_all(out, view)
                n = len(view)
            if n == 0:
                raise CheckpointError("file ended before its last tensor's bytes (truncated?)", run.path)
            offset += n
            progress(n)


class _Filler:
    """Fills destination views from runs, one ``preadv`` per group of runs that continue
    one another in one file (a block's consecutive rows), at most IOV_MAX views each; a
    remote file's runs are fetched together at the flush, joined into few requests
    (streamck.storage.remote.RemoteSource.fill)."""

    def __init__(self, reader: Reader):
        self.reader = reader
        self.groups: dict[Path, tuple[int, int, list[memoryview]]] = {}  # path -> (start, end, views)
        self.remote: dict[UrlPath, list[tuple[int, memoryview]]] = {}

    def add(self, run: Run, dest: memoryview) -> None:
        if isinstance(run.path, UrlPath):
            self.remote.setdefault(run.path, []).append((run.offset, dest))
            return
        group = self.groups.get(run.path)
        if group is not None and group[1] == run.offset and len(group[2]) < _IOV_MAX:
            group[2].append(dest)
            self.groups[run.path] = (group[0], run.offset + run.length, group[2])
            return
        if group is not None:
            self._read(run.path, group)
        self.groups[run.path] = (run.offset, run.offset + run.length, [dest])

    def flush(self) -> None:
        for path, group in self.groups.items():
            self._read(path, group)
        self.groups.clear()
        for path, reads in self.remote.items():
            self.reader.remote(path).fill(reads)
        self.remote.clear()

    def _read(self, path: Path, group: tuple[int, int, list[memoryview]]) -> None:
        start, end, views = group
        fd = self.reader.fd(path)
        n = os.preadv(fd, views, start)
        if n == end - start:
            return
        for view in views:  # a short read: finish view by view, or say why
            if n >= len(view):
                n -= len(view)
                start += len(view)
                continue
            read_into(fd, view[n:], start + n, str(path))
            start, n = start + len(view), 0


class TensorStream:
    """A tensor's row-major bytes, read sequentially like a file."""

    def __init__(self, reader: Reader, ref: TensorRef):
        self.reader, self.ref, self.left = reader, ref, ref.nbytes
        self._blocks: Iterator[memoryview] | None = None
        self._runs: Iterator[Run] | None = None
        self._grid = _row_blocks(ref)
        self._pos = 0
        self._parts = iter(ref.parts) if ref.parts is not None else None
        self._part: TensorStream | None = None
        if ref.strides is not None:
            from streamck.source.strided import gather

            src = reader.remote(ref.path) if isinstance(ref.path, UrlPath) else reader.fd(ref.path)
            self._blocks = gather(ref, reader.chunk, src)
        elif self._grid is None and self._parts is None:
            self._runs = ref.runs()
        self._rest: Run | memoryview | None = None  # what the last call left of a run or block

    def readinto(self, view: memoryview) -> int:
        """Fill ``view`` with the next bytes; returns how many (less only at the end)."""
        want = min(len(view), self.left)
        done = 0
        if self._parts is not None:
            while done < want:
                if self._part is None or not self._part.left:
                    self._part = TensorStream(self.reader, next(self._parts))
                done += self._part.readinto(view[done:want])
        elif self._grid is not None:
            _fill_rows(self.reader, self._grid, view[:want], self._pos)
            self._pos += want
            done = want
        elif self._blocks is not None:
            while done < want:
                block = self._rest if self._rest is not None else next(self._blocks)
                n = min(len(block), want - done)
                view[done : done + n] = block[:n]
                self._rest = block[n:] if n < len(block) else None
                done += n
        else:
            filler = _Filler(self.reader)
            while done < want:
                run = self._rest if self._rest is not None else next(self._runs)
                n = min(run.length, want - done)
                filler.add(Run(run.path, run.offset, n), view[done : done + n])
                self._rest = Run(run.path, run.offset + n, run.length - n) if n < run.length else None
                done += n
            filler.flush()
        self.left -= done
        return done


def _row_blocks(ref: TensorRef) -> RowBlocks | None:
    """The row-block view of a tiled tensor whose tiles do not all span whole rows (those
    are a few long runs, read as runs)."""
    if not ref.tiles:  # untiled, or no elements
        return None
    grid = ref.shape if len(ref.tiles[0].offsets) == len(ref.shape) else (ref.numel,)
    blocks = RowBlocks.of(grid, BITS[ref.dtype] // 8, ref.tiles)
    return None if blocks is None or blocks.whole_rows else blocks


def _fill_rows(reader: Reader, grid: RowBlocks, view: memoryview, pos: int) -> None:
    """Fill ``view`` with the tensor's bytes ``[pos, pos + len(view))``: per block, the rows
    the window needs, a batch of at most SCRATCH bytes at a time: one read of the batch's
    span (its rows are consecutive in the block's file), then one strided numpy copy."""
    import numpy as np

    end, rb = pos + len(view), grid.row_bytes
    out = np.frombuffer(view, np.uint8)
    first, stop = pos // rb, (end - 1) // rb + 1  # rows the window touches
    for path, start, r0, r1, c0, width in grid.blocks:
        lo, last = max(first, r0), min(stop, r1) - 1
        col_a = min(max(pos - lo * rb, c0), c0 + width) - c0  # where the window enters the block
        col_b = max(min(end - last * rb, c0 + width), c0) - c0  # and leaves it
        per = max(1, SCRATCH // width)
        for ba in range(lo, last + 1, per):
            bz = min(ba + per, last + 1) - 1
            ca, cb = col_a if ba == lo else 0, col_b if bz == last else width
            a, b = (ba - r0) * width + ca, (bz - r0) * width + cb  # the batch's span in the block
            if a >= b:
                continue
            src = reader.scratch(b - a)
            reader.read_at(path, src, start + a)
            src = np.frombuffer(src, np.uint8)
            edges = [(ba, ca, cb)] if ba == bz else [(ba, ca, width), (bz, 0, cb)]
            for r, x, y in edges:  # rows the window may cut
                if x < y:
                    at, s0 = r * rb + c0 + x - pos, (r - r0) * width + x - a
                    out[at : at + y - x] = src[s0 : s0 + y - x]
            if bz - ba > 1:  # the rows in between lie whole inside the window
                m, at, s0 = bz - ba - 1, (ba + 1) * rb + c0 - pos, (ba + 1 - r0) * width - a
                rows = src[s0 : s0 + m * width].reshape(m, width)
                np.lib.stride_tricks.as_strided(out[at:], (m, width), (rb, 1))[...] = rows
