"""Remote outputs that appear whole or not at all: S3 multipart uploads completed at the end.

Each output file is an ``Upload``: its bytes go up in parts as they come (a few parts in
flight, memory a few parts), but the object exists under its key only once ``complete`` is
called, which the writer does for every file after the last byte of the last one is up; on
any failure ``abort`` drops the parts, and nothing was ever visible. A file smaller than one
part is held until then and put in one request (atomic too). Only ``s3://`` is written:
fsspec's other filesystems have no upload that stays invisible until completed.
"""

from __future__ import annotations

import io
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

from streamck.errors import OutputError, UsageError
from streamck.storage.remote import concurrency, filesystem, remote_errors
from streamck.storage.url import UrlPath

WRITABLE = ("s3", "s3a")
MIN_PART = 8 << 20  # S3 takes parts of 5 MiB and more (the last one excepted)
MAX_PARTS = 9_000  # of S3's 10,000: room for a size estimate that falls short


def part_size(size: int) -> int:
    """Bytes per part for an object of about ``size`` bytes: MIN_PART, or more where that
    many parts would not hold it."""
    return max(MIN_PART, -(-size // MAX_PARTS))


def writable(url: UrlPath) -> None:
    """Refuse (UsageError) a URL whose objects cannot be written whole or not at all."""
    if url.scheme not in WRITABLE:
        raise UsageError(f"{url}: outputs are written to s3:// URLs only yet (read from any fsspec URL)")


class Part(io.BytesIO):
    """A part's bytes as the request reads them: a stream, rewound at the start of every call."""


def _rewind(params: dict, **kwargs) -> None:
    if isinstance(params.get("Body"), Part):
        params["Body"].seek(0)


def rewinding(fs, bucket: str) -> None:
    """Have the client that sends ``bucket``'s requests rewind a Part at the start of every
    call. botocore rewinds a stream between its own attempts only; s3fs retries a failed call
    with the same arguments, and a stream left where the failed request stopped would send
    its tail: a short part, or, for the last one, a truncated object."""
    from fsspec.asyn import sync

    client = sync(fs.loop, fs.get_s3, bucket)
    client.meta.events.register("before-parameter-build.s3.UploadPart", _rewind, unique_id="streamck-rewind-part")


class Upload:
    """One object at ``url`` written in parts of ``part`` bytes: ``write`` as bytes come,
    then ``complete`` (the object appears) or ``abort`` (it never does)."""

    def __init__(self, url: UrlPath, part: int = MIN_PART):
        writable(url)
        self.url, self.part = url, part
        self.fs = filesystem(url)
        self.bucket, _, self.key = url.key.partition("/")
        self.size = 0
        self._buffer = bytearray()  # the part being filled, allocated whole
        self._filled = 0
        self._id: str | None = None
        self._parts: list[Future] = []
        self._pending: deque[Future] = deque()
        self._pool: ThreadPoolExecutor | None = None
        self._ahead = concurrency()

    def _call(self, method: str, **kwargs) -> dict:
        with remote_errors(self.url, OutputError, "cannot write"):
            return self.fs.call_s3(method, Bucket=self.bucket, Key=self.key, **kwargs)

    def write(self, data: bytes | memoryview) -> None:
        """Take ``data``; each full part goes up (a few at once, the oldest waited for beyond that)."""
        view = memoryview(data).cast("B")
        self.size += len(view)
        while view:
            if not self._buffer:
                self._buffer, self._filled = bytearray(self.part), 0  # exactly a part: no growth, no slack
            take = min(len(view), self.part - self._filled)
            self._buffer[self._filled : self._filled + take] = view[:take]
            self._filled += take
            view = view[take:]
            if self._filled == self.part:
                self._send(self._rest())

    def _rest(self) -> bytearray:
        """The part being filled, cut to what it holds, and a fresh start."""
        body, self._buffer = self._buffer, bytearray()
        del body[self._filled :]
        self._filled = 0
        return body

    def _send(self, body: bytearray) -> None:
        if self._id is None:
            self._id = self._call("create_multipart_upload")["UploadId"]
            with remote_errors(self.url, OutputError, "cannot write"):
                rewinding(self.fs, self.bucket)
            self._pool = ThreadPoolExecutor(self._ahead, thread_name_prefix="streamck-put")
        number = len(self._parts) + 1
        # A stream, not bytes: the request then sends it a block at a time, where bytes go to
        # asyncio's transport in one write, which keeps a copy of what the socket did not take
        # at once (most of a part, for each part in flight: 175 MiB peak s3 -> s3, 154 so).
        stream = Part(body)  # a copy (BytesIO shares only bytes): the bytearray goes at once
        del body
        future = self._pool.submit(self._call, "upload_part", UploadId=self._id, PartNumber=number, Body=stream)
        self._parts.append(future)
        self._pending.append(future)
        while len(self._pending) >= self._ahead:
            self._pending.popleft().result()  # raises the part's failure here, at the writer

    def finish(self) -> None:
        """Send what is left and wait for every part: all is up but not yet visible."""
        if self._id is not None:
            if self._buffer:
                self._send(self._rest())
            for future in self._parts:
                future.result()

    def complete(self) -> None:
        """Make the object appear under its key, whole."""
        self.finish()
        if self._id is None:  # smaller than a part: one put, as atomic
            self._call("put_object", Body=self._rest())
        else:
            parts = [{"PartNumber": i, "ETag": f.result()["ETag"]} for i, f in enumerate(self._parts, 1)]
            self._call("complete_multipart_upload", UploadId=self._id, MultipartUpload={"Parts": parts})
        self.fs.invalidate_cache(self.url.key)  # fsspec's listings here (and above) no longer hold
        self._close()

    def abort(self) -> None:
        """Drop every part sent; the object never appears. Best effort: the server may be gone
        (a bucket's lifecycle rule for incomplete uploads then removes them)."""
        for future in self._parts:
            future.cancel()
        if self._id is not None:
            try:
                self._call("abort_multipart_upload", UploadId=self._id)
            except Exception:
                pass
        self._close()

    def _close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._id, self._buffer, self._filled = None, bytearray(), 0


def delete(url: UrlPath) -> None:
    """Remove the object at ``url`` (there or not)."""
    fs = filesystem(url)
    with remote_errors(url, OutputError, "cannot remove"):
        try:
            fs.rm_file(url.key)
        except FileNotFoundError:
            pass
    fs.invalidate_cache(url.parent.key)
