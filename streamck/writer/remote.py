"""A rewrite into a bucket: every output file a multipart upload, all completed at the end.

The shard writer writes into a pipe, as it writes a stream (``-o -``); a thread reads the
pipe and sends the bytes up in parts (streamck.storage.upload), so memory stays a few parts
and no byte touches the local disk. No object appears until every file is up: then the
shards are completed, the side files, and the index last; an existing output replaced with
``force`` loses its index first and its stale weights after, as a local directory does
(streamck.writer.atomic). On any failure every upload is aborted and the target is as it was.
"""

from __future__ import annotations

import errno
import fcntl
import fnmatch
import os
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from streamck.errors import OutputError, UsageError
from streamck.plan import Plan
from streamck.storage import UrlPath
from streamck.storage.remote import info, listdir
from streamck.storage.upload import Upload, delete, part_size, writable
from streamck.writer.atomic import EXISTS_DIR, INDEX_FILES, STALE_WEIGHTS
from streamck.writer.destination import Destination, side_pieces
from streamck.writer.layout import Shard
from streamck.writer.options import WriteOptions
from streamck.writer.shardwriter import ShardWriter

PIPE_SIZE = 1 << 20  # the pipe between writer and uploader: fewer wake-ups than the default 64 KiB
READ = 1 << 20


def _is_weights(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, g) for g in STALE_WEIGHTS)


def check_remote_target(out: UrlPath, sources: Iterable[Path], is_dir: bool, force: bool) -> None:
    """Refuse what a local target refuses (streamck.writer.atomic.check_target): the source
    itself or a folder holding it, an existing file or a non-empty folder without ``force``.
    With ``force`` a folder is written into: the output's files and an earlier export's
    weights and indexes are replaced, anything else there stays."""
    writable(out)
    for src in sources:
        if isinstance(src, UrlPath) and (src == out or out in src.parents):
            raise OutputError("refusing to write over the source checkpoint", out)
    found = info(out, fresh=True)
    if found is None:
        return
    kind = found.get("type")
    if not is_dir and kind == "directory":
        raise OutputError("is a folder; a .safetensors output is one file", out)
    if is_dir and kind == "file":
        raise OutputError("is a file; a directory output replaces only a folder", out)
    if is_dir and not listdir(out, fresh=True):
        return
    if not force:
        raise OutputError(EXISTS_DIR if is_dir else "already exists; pass {force} to replace it", out)


class PipeUpload:
    """A pipe whose bytes become one Upload: ``fd`` is what the writer writes to; a thread
    sends what arrives. ``close`` raises the uploader's failure, if any."""

    def __init__(self, upload: Upload):
        self.upload, self.error, self.failed = upload, None, False
        read, self.fd = os.pipe()
        try:
            fcntl.fcntl(self.fd, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
        except OSError:
            pass  # a smaller pipe is only slower
        self._thread = threading.Thread(target=self._drain, args=(read,), name="streamck-upload", daemon=True)
        self._thread.start()

    def _drain(self, read: int) -> None:
        try:
            while data := os.read(read, READ):
                self.upload.write(data)
            if not self.failed:  # the end of the writer's bytes, not a writer that gave up
                self.upload.finish()
        except BaseException as e:
            self.error = e
        finally:
            os.close(read)  # the writer's next write then fails (EPIPE) instead of blocking

    def close(self, failed: bool = False) -> None:
        """Close the writer's end and wait for the uploader; raise its failure unless the
        writer ``failed`` (its own error is the one to tell)."""
        self.failed = self.failed or failed
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self._thread.join()
        if self.error is not None and not self.failed:
            raise self.error


def _send_shard(writer: ShardWriter, shard: Shard, upload: Upload) -> None:
    """Stream ``shard`` into ``upload``; the uploader's failure wins over the broken pipe it
    causes, the writer's own (a source that cannot be read) over the uploader's."""
    pipe = PipeUpload(upload)
    try:
        writer.write(shard, pipe.fd)
    except OSError as e:
        if e.errno != errno.EPIPE:
            pipe.close(failed=True)
            raise OutputError(f"write failed: {e.strerror or e}", upload.url) from None
    except BaseException:
        pipe.close(failed=True)
        raise
    pipe.close()
    if upload.size != shard.size:
        raise OutputError(f"wrote {upload.size} bytes where the layout has {shard.size}", upload.url)


def _send_extra(data: Path | UrlPath | bytes, url: UrlPath, uploads: list[Upload]) -> None:
    """A side file (bytes, a local or remote file, or a folder of them) as uploads, not yet completed."""
    if isinstance(data, bytes):
        upload = Upload(url)
        upload.write(data)
        uploads.append(upload)
    elif data.is_dir():
        for entry in sorted(data.iterdir()):
            _send_extra(entry, url / entry.name, uploads)
    else:  # a config, a tokenizer, or a 256 MiB data.npz: in pieces, never whole
        upload = Upload(url, part_size(_size(data)))
        for piece in side_pieces(data):
            upload.write(piece)
        upload.finish()
        uploads.append(upload)


def _size(path: Path | UrlPath) -> int:
    from streamck.storage.remote import info

    return (info(path) or {}).get("size", 0) if isinstance(path, UrlPath) else path.stat().st_size


class Bucket(Destination):
    """A file or a folder in a bucket: each file a multipart upload, completed only once
    every one has all its parts and the source is checked unchanged; the shards first, then
    the side files, the index last. On any failure every upload is aborted."""

    def __init__(self, out: UrlPath, plan: Plan, options: WriteOptions, single: bool):
        super().__init__(out, plan, options)
        self.single, self.uploads, self.side, self.extras = single, {}, [], []

    def check(self, shards: list[Shard], extras: list[str]) -> None:
        if self.options.verify:
            raise UsageError("{verify} re-reads the output from disk: not for URL outputs yet")
        if self.options.part is not None:
            raise UsageError("{part} writes into a folder shared by its runs: not to URLs yet")
        check_remote_target(self.out, self.sources, not self.single, self.options.force)

    def arrange(self, shards: list[Shard]) -> list[Shard]:
        self.uploads = dict.fromkeys(s.filename for s in shards)  # their number says where they go (_url)
        for s in shards:
            self.uploads[s.filename] = Upload(self._url(s), part_size(s.size))
        self.shards = shards
        return shards

    def _url(self, shard: Shard) -> UrlPath:
        if self.single and len(self.uploads) > 1:  # a file output split into numbered files beside it
            return self.out.parent / shard.filename
        return self.out if self.single else self.out / shard.filename

    @contextmanager
    def open(self) -> Iterator[None]:
        done: list[Upload] = []
        try:
            yield
            index = [u for u in self.side if u.url.name in INDEX_FILES]
            if self.options.force and not self.single:
                for name in INDEX_FILES:  # no index may name a mix of old and new shards
                    delete(self.out / name)
            for upload in [*self.uploads.values(), *(u for u in self.side if u not in index), *index]:
                upload.complete()
                done.append(upload)
        except BaseException:
            for upload in [*self.uploads.values(), *self.side]:
                if upload not in done:
                    upload.abort()
            for upload in done:  # a completion failed midway: what did appear goes again (best effort)
                _forget(upload.url)
            raise
        if self.options.force and not self.single:
            self._remove_stale()

    def _remove_stale(self) -> None:
        names = {*self.uploads, *self.extras}
        for name, entry in listdir(self.out, fresh=True).items():
            if name not in names and entry.get("type") == "file" and _is_weights(name):
                delete(self.out / name)

    def write(self, writer: ShardWriter, shard: Shard) -> None:
        _send_shard(writer, shard, self.uploads[shard.filename])

    def put(self, extras: dict[str, Path | bytes]) -> None:
        if not self.single:
            for name, data in extras.items():
                _send_extra(data, self.out / name, self.side)
            self.extras = sorted(extras)

    def files(self) -> list[UrlPath]:
        return [self._url(s) for s in self.shards] + [self.out / n for n in self.extras]


def _forget(url: UrlPath) -> None:
    try:
        delete(url)
    except Exception:  # the server that failed a completion may fail this too: the error to tell is the first
        pass
