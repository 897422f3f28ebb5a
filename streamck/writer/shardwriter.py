"""Moving one shard's bytes: its header, then every tensor copied, gathered or cast."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from pathlib import Path

from streamck.errors import OutputError
from streamck.fileio import start_writeback, write_all
from streamck.plan import OutputTensor
from streamck.source.reader import CHUNK, Reader
from streamck.storage import UrlPath
from streamck.transforms.base import DEVICE
from streamck.writer import formats
from streamck.writer.clone import Sharing, copy_shared, spans
from streamck.writer.layout import Shard
from streamck.writer.progress import Silent

_DROP_EVERY = 256 << 20
WRITEBACK_EVERY = 64 << 20


class Writeback:
    """A progress callback that also has the disk start on each WRITEBACK_EVERY bytes
    written to ``fd``, so that copying and the disk's work overlap and the closing fsync
    finds little left (``cp`` then ``sync`` does them in turn: on 1 GiB here, the fsync
    was half the time). The requests go to ``pool``'s thread, since one blocks while the
    disk's queue is full (0.2 s of a 1 s ZeRO consolidation when made inline). Use it as a
    context manager around the writes: leaving waits for every request, before ``fd`` is
    closed. Off for good at the first fd or system that cannot."""

    def __init__(self, fd: int, progress: Callable[[int], None], pool: ThreadPoolExecutor):
        self.fd, self.progress, self.pool = fd, progress, pool
        self.pending = self.started = 0
        self.enabled = True
        self.last: Future | None = None

    def __call__(self, n: int) -> None:
        self.progress(n)
        self.pending += n
        if self.pending >= WRITEBACK_EVERY and self.enabled:
            self.pending = 0
            try:
                end = os.lseek(self.fd, 0, os.SEEK_CUR)
            except OSError:  # a pipe
                self.enabled = False
                return
            self.last = self.pool.submit(self._start, self.started, end - self.started)
            self.started = end

    def _start(self, offset: int, length: int) -> None:
        if self.enabled:
            self.enabled = start_writeback(self.fd, offset, length)

    def __enter__(self) -> Writeback:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.last is not None:  # the pool runs them in order: the last done, all done
            self.last.result()


class ShardWriter:
    """Streams shards into fds: header, then each tensor copied, gathered or cast.

    One per rewrite: its reader keeps the source fds open and its buffers are reused.
    With ``sharing``, unchanged tensors in step with their source share its blocks
    (streamck.writer.clone); ``shared`` counts those bytes.
    """

    def __init__(
        self,
        chunk: int,
        device: str | None,
        drop_cache: bool,
        progress: Callable[[int], None],
        sharing: Sharing | None = None,
        started: Callable[[str], None] = lambda name: None,
    ):
        self.reader = Reader(min(chunk, CHUNK))
        self.started = started  # told each tensor's name as its bytes start (the progress log shows it)
        self.sharing, self.shared = sharing, 0
        self.caster = None
        self.chunk, self.device = chunk, device
        self.drop_cache = drop_cache
        self.progress = progress
        self.overflow: dict[str, int] = {}
        self._cpu_caster = None
        self._writeback_pool: ThreadPoolExecutor | None = None
        # the transforms' buffers, kept from tensor to tensor, and the device their torch engines use
        self._space: dict = {DEVICE: device or "cpu"}

    def close(self) -> None:
        for caster in (self.caster, self._cpu_caster):
            if caster is not None:
                caster.close()
        if self._writeback_pool is not None:
            self._writeback_pool.shutdown()
        self.reader.close()

    def writeback_pool(self) -> ThreadPoolExecutor:
        """The thread that asks the disk to start on written ranges (see Writeback)."""
        if self._writeback_pool is None:
            self._writeback_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamck-writeback")
        return self._writeback_pool

    def get_caster(self):
        """The caster for this run, made (torch imported, buffers allocated, the device
        checked) on first use; call it before writing to fail before any file exists."""
        if self.caster is None:
            from streamck.transforms.casters import make_caster

            self.caster = make_caster(self.device or "cpu", self.chunk)
        return self.caster

    def write(self, shard: Shard, out: int) -> None:
        """Write ``shard`` into ``out`` as its format lays it out (streamck.writer.formats)."""
        formats.get(shard.format).write(shard, self, out)

    def copy(self, tensors: Sequence[OutputTensor], out: int, align: int = 1) -> None:
        """Write ``tensors``' bytes to ``out`` in order, each padded with zeros to a multiple of
        ``align``: unchanged runs copied kernel-side (or sharing the source's blocks), casts
        and transforms computed chunk by chunk."""
        since_drop = 0
        groups = spans(tensors) if align == 1 else (g for t in tensors for g in spans([t]))
        with Writeback(out, self.progress, self.writeback_pool()) as progress:
            for group, span in groups:
                self._copy_group(group, span, out, progress)
                if align > 1 and (pad := -group[0].nbytes % align):
                    write_all(out, bytes(pad))
                if self.drop_cache:
                    since_drop = self._drop(group, out, since_drop)

    def _copy_group(self, group: list[OutputTensor], span, out: int, progress: Callable[[int], None]) -> None:
        self.started(group[0].name)
        if span is not None and self.sharing is not None:  # unchanged tensors continuing one another
            self.shared += copy_shared(self.reader, span, out, self.sharing, progress, self.progress)
        elif span is not None:  # a stream (-o -): one copy all the same
            self.reader.copy(span, out, progress)
        elif (t := group[0]).transform is not None:
            for view in self.computed(t):
                write_all(out, view)
                progress(len(view))
        elif t.is_cast:
            n = self.get_caster().cast(self.reader.stream(t.source), t.dtype, out, progress)
            if n:
                self.overflow[t.name] = n
        else:
            self.reader.copy(t.source, out, progress)

    def _drop(self, group: list[OutputTensor], out: int, since_drop: int) -> int:
        """``--drop-cache``: the group's source pages, and every _DROP_EVERY bytes the output's."""
        for t in group:
            for path in (p for p in t.source.paths if not isinstance(p, UrlPath)):
                os.posix_fadvise(self.reader.fd(path), 0, 0, os.POSIX_FADV_DONTNEED)
            since_drop += t.nbytes
        if since_drop >= _DROP_EVERY:
            os.fdatasync(out)  # only clean pages can be dropped
            os.posix_fadvise(out, 0, 0, os.POSIX_FADV_DONTNEED)
            since_drop = 0
        return since_drop

    def put(self, out: int, pieces: Iterable[bytes | memoryview]) -> None:
        """Write ``pieces`` to ``out``, the disk told to start on them as they come; their
        progress is counted where they are made (pieces())."""
        with Writeback(out, lambda n: None, self.writeback_pool()) as writeback:
            for piece in pieces:
                write_all(out, piece)
                writeback(len(piece))

    def pieces(self, t: OutputTensor) -> Iterator[memoryview]:
        """``t``'s output bytes in bounded pieces: its source's, computed, or cast (on the CPU)."""
        self.started(t.name)
        if t.transform is not None:
            for view in self.computed(t):
                self.progress(len(view))
                yield view
            return
        if not t.is_cast:
            for view in self.reader.windows(t.source):
                self.progress(len(view))
                yield view
            return
        overflow = 0
        for view, inf in self.cpu_caster().convert(self.reader.stream(t.source), t.dtype):
            overflow += inf
            self.progress(len(view))
            yield view
        if overflow:
            self.overflow[t.name] = overflow

    def computed(self, t: OutputTensor) -> Iterator[memoryview]:
        """A computed tensor's bytes, from its transform (streamck.transforms)."""
        return t.transform.pieces(t, self.reader, self._space)

    def cpu_caster(self):
        """A CPU caster: this run's own when it casts on the CPU, else one made on first use."""
        if (self.device or "cpu") == "cpu":
            return self.get_caster()
        if self._cpu_caster is None:
            from streamck.transforms.casters import make_caster

            self._cpu_caster = make_caster("cpu", self.chunk)
        return self._cpu_caster

    def write_file(self, shard: Shard, path: Path) -> None:
        """Write ``shard`` into a new file at ``path``; syncing it is the caller's (see Syncer).
        A file whose size is not the layout's (a source that shrank, a short copy) is an error."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            self.write(shard, fd)
            written = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if written != shard.size:
            raise OutputError(f"wrote {written} bytes where the layout has {shard.size}", path)


class _Stopped(Exception):
    """Raised in a worker at its next chunk once another worker has failed."""


class Workers:
    """``jobs`` threads sharing as many ShardWriters (each its own buffers, fds, caster),
    doing ``fn(writer, item)`` for every item. Kernel copies, reads and numpy release the
    GIL, so shards are written truly at once. The first error, wherever it happens, stops
    the others at their next chunk and is raised once all have stopped, so nothing writes
    into a temporary that is being removed. One job runs inline, on the calling thread."""

    def __init__(
        self,
        jobs: int,
        chunk: int,
        device: str | None,
        drop_cache: bool,
        progress: Silent,
        sharing: Sharing | None = None,
    ):
        self.jobs, self._stop, self.bar = jobs, threading.Event(), progress
        lock = threading.Lock()

        def checked(n: int) -> None:
            if self._stop.is_set():
                raise _Stopped
            with lock:
                progress(n)

        counted = checked if jobs > 1 else progress
        self._make = lambda: ShardWriter(chunk, device, drop_cache, counted, sharing, progress.tensor)
        self.first = self._make()  # made now, so that a missing caster fails before any file exists
        self.writers = [self.first]

    def map(self, fn: Callable[[ShardWriter, object], None], items: list) -> None:
        if self.jobs == 1 or len(items) <= 1:
            for item in items:
                fn(self.first, item)
            return
        while len(self.writers) < min(self.jobs, len(items)):
            self.writers.append(self._make())
        idle: queue.SimpleQueue[ShardWriter] = queue.SimpleQueue()
        for writer in self.writers:
            idle.put(writer)

        def run(item: object) -> None:
            if self._stop.is_set():
                raise _Stopped
            writer = idle.get()
            try:
                fn(writer, item)
            finally:
                idle.put(writer)

        self._stop.clear()
        with ThreadPoolExecutor(self.jobs, thread_name_prefix="streamck-job") as pool:
            futures = [pool.submit(run, item) for item in items]
            try:
                wait(futures, return_when=FIRST_EXCEPTION)
                failed = next((f for f in futures if f.done() and f.exception() is not None), None)
                if failed is not None:
                    raise failed.exception()
            except BaseException:
                self._stop.set()
                for future in futures:
                    future.cancel()
                wait(futures)
                raise

    @property
    def overflow(self) -> dict[str, int]:
        return {k: v for w in self.writers for k, v in w.overflow.items()}

    @property
    def shared(self) -> int:
        """Bytes written by sharing the source's blocks (streamck.writer.clone)."""
        return sum(w.shared for w in self.writers)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()


class Syncer:
    """fsyncs finished files on a background thread, so that one shard's flush to disk
    overlaps the writing of the next (as ``cp`` then ``sync`` overlaps them)."""

    def __init__(self, drop_cache: bool = False):
        self.drop_cache = drop_cache
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamck-fsync")
        self._pending: list[Future] = []

    def _sync(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            if self.drop_cache:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean now, so it can go
        finally:
            os.close(fd)

    def submit(self, path: Path) -> None:
        self._pending.append(self._pool.submit(self._sync, path))

    def wait(self) -> None:
        """Block until every submitted file is on disk; re-raise the first failure."""
        try:
            for future in self._pending:
                future.result()
        finally:
            self._pending.clear()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
