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
from collections.abc import Iterable
from pathlib import Path

from streamck.errors import OutputError, listing
from streamck.storage import UrlPath
from streamck.storage.remote import info, listdir
from streamck.storage.upload import Upload, delete, part_size, writable
from streamck.writer.atomic import INDEX_FILES, STALE_WEIGHTS
from streamck.writer.layout import Shard
from streamck.writer.shardwriter import ShardWriter, Workers

PIPE_SIZE = 1 << 20  # the pipe between writer and uploader: fewer wake-ups than the default 64 KiB
READ = 1 << 20


def _is_weights(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, g) for g in STALE_WEIGHTS)


def check_remote_target(out: UrlPath, sources: Iterable[Path], is_dir: bool, force: bool, writes: list[str]) -> None:
    """Refuse what a local target refuses (streamck.writer.atomic.check_target): the source
    itself or a folder holding it, an existing file without ``force``, a folder holding
    anything but weights, indexes and the files this output writes (force or not), and a
    non-empty folder without ``force``."""
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
    if is_dir:
        entries = listdir(out, fresh=True)
        if not entries:
            return
        foreign = sorted(
            n + ("/" if e.get("type") == "directory" else "")
            for n, e in entries.items()
            if n not in writes and not (e.get("type") == "file" and _is_weights(n))
        )
        if foreign:
            raise OutputError(
                f"holds files that are not part of an earlier export: {listing(foreign)}; "
                "{force} replaces only weights and the files this output writes (move them or pick another folder)",
                out,
            )
    if not force:
        raise OutputError("already exists; pass {force} to replace it", out)


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
    else:
        _send_extra(data.read_bytes(), url, uploads)  # config, tokenizer: small


def write_remote(
    out: UrlPath,
    shards: list[Shard],
    extras: dict[str, Path | UrlPath | bytes],
    workers: Workers,
    single: bool,
    force: bool,
    before_commit=lambda: None,
) -> list[UrlPath]:
    """Upload ``shards`` (and for a folder output ``extras``) under ``out``; complete them all
    only after ``before_commit`` (the source's unchanged check) passes. Returns their URLs."""
    urls = [out] if single else [out / s.filename for s in shards]
    uploads = [Upload(u, part_size(s.size)) for u, s in zip(urls, shards, strict=True)]
    done: list[Upload] = []
    side: list[Upload] = []
    try:
        workers.map(lambda w, i: _send_shard(w, shards[i], uploads[i]), list(range(len(shards))))
        for name, data in ({} if single else extras).items():
            _send_extra(data, out / name, side)
        before_commit()
        index = [u for u in side if u.url.name in INDEX_FILES]
        if force and not single:
            for name in INDEX_FILES:  # no index may name a mix of old and new shards
                delete(out / name)
        for upload in [*uploads, *(u for u in side if u not in index), *index]:
            upload.complete()
            done.append(upload)
    except BaseException:
        for upload in uploads + side:
            if upload not in done:
                upload.abort()
        raise
    if force and not single:
        names = {s.filename for s in shards} | set(extras)
        for name, entry in listdir(out, fresh=True).items():
            if name not in names and entry.get("type") == "file" and _is_weights(name):
                delete(out / name)
    return urls + ([] if single else [out / n for n in sorted(extras)])
