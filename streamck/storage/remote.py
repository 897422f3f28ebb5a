"""Remote files through fsspec: ranged reads, a few in flight, never a whole file in memory.

fsspec and the filesystem package for a URL's scheme (s3fs for ``s3://``) are imported on
the first URL, so that local runs never pay for them; a missing one is a UsageError naming
the package to install. Credentials and the endpoint are the filesystem's own business: s3fs
reads what the AWS CLI reads (``AWS_ENDPOINT_URL``, ``AWS_PROFILE``, ``~/.aws/config``,
``AWS_ACCESS_KEY_ID`` …). Any failure of a request is one line naming the URL.
URLs come as streamck.storage.UrlPath (``.scheme``, ``.key``), typed here as the
PurePosixPath it is: streamck.storage.url imports this module.
"""

from __future__ import annotations

import io
import os
import sys
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import PurePosixPath

from streamck.errors import CheckpointError, StreamckError, UsageError

CONCURRENCY_ENV = "STREAMCK_REMOTE_CONCURRENCY"
CONCURRENCY = 4  # ranged requests (or part uploads) in flight per file
PIECE = 8 << 20  # bytes per ranged GET of a long run (a few in flight, each read into a buffer of its own)
BLOCK = 4 << 20  # a read at least this long is split over the requests in flight
GAP = 64 << 10  # bytes between two short reads fetched (and dropped) rather than paid a request for
CHUNK = 1 << 20  # what one read of a GET's body asks for
FILE_BUFFER = 8 << 10  # what one small read of a pickle or zip directory fetches (a DCP blob: its tensor follows)
EXTRA = "pip install s3fs (or pip install '.[remote]' in a streamck checkout)"


M_MMAP_THRESHOLD, MMAP_THRESHOLD = -3, 1 << 20  # glibc's mallopt parameter, and its value here
_threshold_set = False


def concurrency() -> int:
    """Requests in flight per file: the current call's (streamck.storage.requests_in_flight),
    else ``STREAMCK_REMOTE_CONCURRENCY``, else CONCURRENCY."""
    from streamck.storage.inflight import REQUESTS

    chosen = REQUESTS.get()
    if chosen is not None:
        return chosen
    raw = os.environ.get(CONCURRENCY_ENV, "")
    try:
        value = int(raw) if raw else CONCURRENCY
    except ValueError:
        raise UsageError(f"{CONCURRENCY_ENV}={raw!r}: give a number of requests, such as 4") from None
    if value < 1:
        raise UsageError(f"{CONCURRENCY_ENV}={raw!r}: must be at least 1")
    return value


def filesystem(url: PurePosixPath):
    """The fsspec filesystem for ``url``'s scheme (fsspec keeps one instance per set of options)."""
    try:
        import fsspec
        from fsspec.registry import known_implementations
    except ModuleNotFoundError:
        raise UsageError(f"{url}: reading and writing URLs needs fsspec: {EXTRA}") from None
    try:
        cls = fsspec.get_filesystem_class(url.scheme)
    except ValueError:
        raise UsageError(f"{url}: no fsspec filesystem knows the scheme {url.scheme}://") from None
    except ImportError:
        package = known_implementations.get(url.scheme, {}).get("class", url.scheme).split(".")[0]
        what = f"{EXTRA}" if package == "s3fs" else f"pip install {package}"
        raise UsageError(f"{url}: {url.scheme}:// needs the {package} package: {what}") from None
    if getattr(cls, "async_impl", False):
        _quiet_loop()
    _fixed_mmap_threshold()
    return cls()


def _fixed_mmap_threshold() -> None:
    """Have glibc's malloc map every block of MMAP_THRESHOLD or more afresh and unmap it when
    freed. By default a freed mapped block raises the threshold to its size, and from then on
    the 8 MiB requests and parts come from the threads' heaps, which keep what is freed: an
    s3 -> s3 rewrite held 216 MiB where it needs 173. Process-wide, for a library caller too:
    blocks of 1 MiB or more are mapped and unmapped each time (the default before the first
    such free), at a syscall per block. Not glibc: nothing to do."""
    global _threshold_set
    if _threshold_set:
        return
    _threshold_set = True
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    except (OSError, AttributeError):
        pass


def _quiet_loop() -> None:
    """Keep fsspec's event loop from logging the connection errors of requests cut short (a
    server that died mid-transfer): the failed call raises them already, as one line."""
    from fsspec.asyn import get_loop

    loop = get_loop()

    def handler(loop, context: dict) -> None:
        if not isinstance(context.get("exception"), OSError | ConnectionError):
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


def one_line(e: BaseException) -> str:
    """An exception as the first line of what it says, with its type when it says nothing."""
    text = str(e).strip().splitlines()
    return text[0] if text and text[0] else type(e).__name__


@contextmanager
def remote_errors(url: PurePosixPath, error: type[StreamckError] = CheckpointError, doing: str = "cannot read"):
    """Any failure of a request inside as one ``error`` line naming ``url``."""
    try:
        yield
    except StreamckError:
        raise
    except FileNotFoundError:
        raise error("no such file or directory (or bucket)", url) from None
    except PermissionError as e:
        raise error(f"{doing}: access denied ({one_line(e)}); check the credentials", url) from None
    except Exception as e:
        raise error(f"{doing}: {one_line(e)}", url) from None


def info(url: PurePosixPath, fresh: bool = False) -> dict | None:
    """What the filesystem says of ``url`` (``type``, ``size`` …); None when nothing is there.
    ``fresh`` drops what fsspec remembers of its folder first (an output being checked)."""
    fs = filesystem(url)
    if fresh:
        fs.invalidate_cache(url.key)
    with remote_errors(url):
        try:
            return fs.info(url.key)
        except FileNotFoundError:
            return None


def entry(url: PurePosixPath) -> dict | None:
    """``url``'s entry in its folder's listing (``type``, ``size`` …), None when it has none;
    the listing is one request that fsspec keeps for the next question. A bucket is asked itself."""
    filesystem(url)  # a missing package is said of the URL asked about, not of its folder
    if len(url.parts) <= 2:  # s3:/bucket
        return info(url)
    try:
        return listdir(url.parent).get(url.name)
    except CheckpointError:  # the folder may not be listable (a public object, a narrow policy): ask the URL
        return info(url)


def forget(url: PurePosixPath) -> None:
    """Drop what fsspec remembers of ``url``'s listing and its parents' (a run root read again
    sees the steps a trainer added since)."""
    filesystem(url).invalidate_cache(url.key)


def listdir(url: PurePosixPath, fresh: bool = False) -> dict[str, dict]:
    """The entries of the folder ``url`` by name (each its info); empty when there is none."""
    fs = filesystem(url)
    if fresh:
        fs.invalidate_cache(url.key)
    with remote_errors(url):
        try:
            entries = fs.ls(url.key, detail=True)
        except FileNotFoundError:
            return {}
    return {e["name"].rstrip("/").rpartition("/")[2]: e for e in entries if e["name"].rstrip("/") != url.key}


def read_bytes(url: PurePosixPath) -> bytes:
    """A small file's bytes (an index, a config): side files only, never a weights file.
    FileNotFoundError when there is none, as a local path's read_bytes raises."""
    fs = filesystem(url)
    with remote_errors(url):
        try:
            return fs.cat_file(url.key)
        except FileNotFoundError:
            pass
    raise FileNotFoundError(2, "No such file or directory", str(url))


def remote_stamp(url: PurePosixPath) -> tuple[int, int, str]:
    """``url``'s size, modification time (ns) and ETag as the server says them now."""
    found = info(url, fresh=True)
    if found is None:
        raise FileNotFoundError(2, "No such file or directory", str(url))
    modified = found.get("LastModified") or found.get("mtime") or found.get("updated")
    ns = int(modified.timestamp() * 1e9) if hasattr(modified, "timestamp") else 0
    tag = found.get("ETag") or found.get("etag") or found.get("md5Hash") or ""
    return int(found["size"]), ns, str(tag)


class RemoteSource:
    """A remote file read by ranged GETs: a long read in PIECE requests, up to concurrency()
    in flight and delivered in order (``pieces``); a short one exactly (``readinto``); many
    short ones joined into few requests (``fill``)."""

    def __init__(self, url: PurePosixPath, fs, size: int):
        self.url, self.fs, self.size = url, fs, size
        self._ranged = _s3_ranged(fs) or _http_ranged(fs)  # None: fsspec's cat_file
        self._pool: ThreadPoolExecutor | None = None
        self._ahead = concurrency()

    @classmethod
    def open(cls, url: PurePosixPath) -> RemoteSource:
        found = info(url)
        if found is None:
            raise CheckpointError("no such file or directory (or bucket)", url)
        if found.get("type") != "file":
            raise CheckpointError("is a directory, expected a file", url)
        return cls(url, filesystem(url), int(found["size"]))

    def get(self, start: int, end: int) -> bytes | bytearray:
        """The bytes ``[start, end)``, all of them, in one request. Where the request is ours
        (s3, HTTP), the body is read to what was asked and no further, and a server that
        answers with the whole file instead of the range is said to ignore ranges."""
        with remote_errors(self.url):
            try:
                if self._ranged is not None:
                    data = self._ranged(self.url.key, start, end)
                else:
                    data = self.fs.cat_file(self.url.key, start=start, end=end)
            except RangeIgnored as e:
                raise CheckpointError(str(e), self.url) from None
        if len(data) != end - start:
            raise CheckpointError("file ended before its last tensor's bytes (truncated?)", self.url)
        return data

    def readinto(self, view: memoryview, offset: int) -> None:
        """Exactly the bytes asked for (a header reads 8 bytes, then its length): one request,
        or for a long read PIECE-sized ones a few at a time."""
        n = len(view)
        if n < BLOCK:
            view[:] = self.get(offset, offset + n)
            return
        at = 0
        for data in self.pieces(offset, n, max(BLOCK // 4, -(-n // self._ahead))):  # split over those in flight
            view[at : at + len(data)] = data
            at += len(data)

    def fill(self, reads: list[tuple[int, memoryview]]) -> None:
        """Fill each view with the bytes at its offset: the reads sorted by offset and joined
        where they continue one another or lie less than GAP apart (the gap fetched and
        dropped), into requests of at most PIECE, a few in flight. A window of small tensors
        written in another order than the file's (renamed ones) costs a few requests, not one
        per tensor, and no byte it does not need but the small gaps."""
        ranges: list[tuple[int, int, list[tuple[int, memoryview]]]] = []
        for offset, view in sorted(reads, key=lambda r: r[0]):
            if ranges and offset - ranges[-1][1] <= GAP and offset + len(view) - ranges[-1][0] <= PIECE:
                start, end, members = ranges[-1]
                ranges[-1] = (start, max(end, offset + len(view)), [*members, (offset, view)])
            else:
                ranges.append((offset, offset + len(view), [(offset, view)]))
        whole = [r for r in ranges if len(r[2]) == 1 and r[1] - r[0] >= BLOCK]  # a long window: split up
        for start, _, [(_, view)] in whole:
            self.readinto(view, start)
        joined = [r for r in ranges if not (len(r[2]) == 1 and r[1] - r[0] >= BLOCK)]
        fetched = self._executor().map(lambda r: self.get(r[0], r[1]), joined)
        for (start, _, members), data in zip(joined, fetched, strict=True):
            for offset, view in members:
                view[:] = data[offset - start : offset - start + len(view)]

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._ahead, thread_name_prefix="streamck-get")
        return self._pool

    def pieces(self, offset: int, length: int, piece: int = PIECE) -> Iterator[bytes]:
        """The bytes ``[offset, offset + length)`` in order, ``piece`` bytes per request, a few
        requests ahead (memory: concurrency() pieces at most)."""
        pool = self._executor()
        starts = iter(range(offset, offset + length, piece))
        end = offset + length
        pending: deque[Future] = deque()
        try:
            for start in starts:
                pending.append(pool.submit(self.get, start, min(start + piece, end)))
                if len(pending) >= self._ahead:
                    break
            while pending:
                data = pending.popleft().result()
                start = next(starts, None)
                if start is not None:
                    pending.append(pool.submit(self.get, start, min(start + piece, end)))
                yield data
        finally:
            for future in pending:
                future.cancel()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def open_file(source: RemoteSource, base: int = 0, length: int | None = None, owned: bool = False) -> io.BufferedReader:
    """A seekable binary file on ``source``'s bytes from ``base`` (``length`` of them, else to
    its end), read by ranges through a FILE_BUFFER buffer: for zip directories and pickles,
    never for tensor data; closing it closes ``source`` when ``owned``. A failed request
    raises CheckpointError naming the URL."""
    from streamck.storage.window import Window

    length = source.size - base if length is None else length
    return io.BufferedReader(Window(source, base, length, owned), FILE_BUFFER)


class RangeIgnored(Exception):
    """A ranged GET answered with something else than the range (a 200 with the whole file)."""

    def __init__(self, status: object, start: int, end: int):
        super().__init__(
            f"the server ignores Range requests (bytes {start}-{end - 1} answered with {status}, not 206 and "
            "the range): streamck reads a checkpoint by ranges, never whole; serve it from one that honours them"
        )


def _whole(start: int, wanted: int, length: int | None) -> bool:
    """Whether an answer that is not a range is still exactly the bytes asked for (the whole file from 0)."""
    return start == 0 and length == wanted


def _s3_ranged(fs):
    """s3fs's ranged GET, its body read as it arrives into one buffer of the range's size (or
    None, for other filesystems and s3fs releases without the calls used): ``cat_file`` gathers
    the body's chunks and joins them, holding each piece twice. Retried as s3fs retries its own
    reads (``_error_wrapper``, ``fs.retries`` times with backoff)."""
    wrapper = getattr(sys.modules.get("s3fs.core"), "_error_wrapper", None)
    if wrapper is None or not hasattr(fs, "_call_s3") or not hasattr(fs, "loop"):
        return None
    from fsspec.asyn import sync

    async def read_into(bucket: str, key: str, version: str | None, start: int, out: bytearray) -> bytearray:
        versioned = {"VersionId": version} if version else {}
        ranged = f"bytes={start}-{start + len(out) - 1}"
        resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=ranged, **versioned)
        body, at = resp["Body"], 0
        if not str(resp.get("ContentRange", "")).startswith(f"bytes {start}-"):
            if not _whole(start, len(out), resp.get("ContentLength")):
                body.close()  # not a byte more of it
                raise RangeIgnored(
                    resp.get("ResponseMetadata", {}).get("HTTPStatusCode", "no range"), start, start + len(out)
                )
        try:
            while at < len(out):
                chunk = await body.read(min(CHUNK, len(out) - at))
                if not chunk:
                    break
                out[at : at + len(chunk)] = chunk
                at += len(chunk)
        finally:
            body.close()
        return out if at == len(out) else out[:at]

    def ranged(path: str, start: int, end: int) -> bytearray:
        bucket, key, version = fs.split_path(path)
        out = bytearray(end - start)
        return sync(fs.loop, wrapper, read_into, args=(bucket, key, version, start, out), retries=fs.retries)

    return ranged


def _http_ranged(fs):
    """fsspec's HTTP filesystem's ranged GET, its body read as it arrives into a buffer of the
    range's size and no further (or None for other filesystems): its ``cat_file`` reads a
    body whole, and a server that ignores ``Range`` sends the whole file for an 8-byte read."""
    if not (hasattr(fs, "set_session") and hasattr(fs, "encode_url") and hasattr(fs, "loop")):
        return None
    from fsspec.asyn import sync

    async def read_into(url: str, start: int, out: bytearray) -> bytearray:
        session = await fs.set_session()
        kw = {k: v for k, v in fs.kwargs.items() if k != "headers"}
        headers = {**fs.kwargs.get("headers", {}), "Range": f"bytes={start}-{start + len(out) - 1}"}
        async with session.get(fs.encode_url(url), headers=headers, **kw) as r:
            if r.status == 404:
                raise FileNotFoundError(2, "No such file or directory", url)
            r.raise_for_status()
            if r.status != 206 and not _whole(start, len(out), r.content_length):
                raise RangeIgnored(r.status, start, start + len(out))  # leaving the block drops the connection
            at = 0
            while at < len(out):
                chunk = await r.content.read(min(CHUNK, len(out) - at))
                if not chunk:
                    break
                out[at : at + len(chunk)] = chunk
                at += len(chunk)
        return out if at == len(out) else out[:at]

    def ranged(url: str, start: int, end: int) -> bytearray:
        return sync(fs.loop, read_into, url, start, bytearray(end - start))

    return ranged
