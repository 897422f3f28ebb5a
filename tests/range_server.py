"""A file server on 127.0.0.1 for the remote tests of hostile input (tests/test_hostile_input.py):
plain HTTP (a folder listing as ``python -m http.server`` writes it) and enough of S3's API for
s3fs to read a bucket (path-style HEAD, GET and ListObjectsV2; credentials not checked).
``ranges=False`` answers a ranged GET as a server that ignores ``Range`` does: 200 and the whole
file. ``sent`` counts the body bytes that left it, so a test sees what a client made it send."""

from __future__ import annotations

import email.utils
import hashlib
import html
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

HOST = "127.0.0.1"
_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, root: Path, ranges: bool):
        super().__init__((HOST, 0), _Handler)
        self.root, self.ranges, self.sent, self.lock = root, ranges, 0, threading.Lock()

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: Server
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        parts = urlsplit(self.path)
        query = parse_qs(parts.query)
        path = self.server.root / unquote(parts.path).lstrip("/")
        if "list-type" in query:  # S3's ListObjectsV2 of a bucket
            return self._send(200, _listing(path, query), "application/xml", body)
        if path.is_dir():
            if not parts.path.endswith("/"):
                self.send_response(301)
                self.send_header("Location", parts.path + "/")
                self.send_header("Content-Length", "0")
                return self.end_headers()
            return self._send(200, _index(path), "text/html", body)
        if not path.is_file():
            return self._send(404, b"", "text/plain", body)
        self._file(path, body)

    def _file(self, path: Path, body: bool) -> None:
        size = path.stat().st_size
        start, end, status = 0, size, 200
        m = _RANGE.match(self.headers.get("Range", ""))
        if m and self.server.ranges:
            start, end, status = int(m[1]), min(size, int(m[2]) + 1 if m[2] else size), 206
        self.send_response(status)
        self.send_header("Content-Length", str(end - start))
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("ETag", f'"{hashlib.md5(str(path.stat().st_mtime_ns).encode()).hexdigest()}"')
        self.send_header("Last-Modified", email.utils.formatdate(path.stat().st_mtime, usegmt=True))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        if not body:
            return
        with open(path, "rb") as f:
            f.seek(start)
            left = end - start
            try:
                while left > 0:
                    chunk = f.read(min(left, 1 << 16))
                    self.wfile.write(chunk)
                    with self.server.lock:
                        self.server.sent += len(chunk)
                    left -= len(chunk)
            except OSError:  # the client stopped reading: what it asked for is all it gets
                self.close_connection = True

    def _send(self, status: int, data: bytes, kind: str, body: bool) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)


def _index(directory: Path) -> bytes:
    links = "".join(
        f'<li><a href="{html.escape(p.name)}{"/" if p.is_dir() else ""}">{html.escape(p.name)}</a></li>'
        for p in sorted(directory.iterdir())
    )
    return f"<html><body><ul>{links}</ul></body></html>".encode()


def _listing(bucket: Path, query: dict[str, list[str]]) -> bytes:
    """ListObjectsV2 of ``bucket`` under ``prefix``, one level (``delimiter=/``)."""
    prefix = query.get("prefix", [""])[0]
    folder = bucket / prefix.rpartition("/")[0]
    contents, prefixes = [], []
    for p in sorted(folder.iterdir()) if folder.is_dir() else []:
        key = str(p.relative_to(bucket))
        if not key.startswith(prefix):
            continue
        if p.is_dir():
            prefixes.append(f"<CommonPrefixes><Prefix>{html.escape(key)}/</Prefix></CommonPrefixes>")
        else:
            when = email.utils.formatdate(p.stat().st_mtime, usegmt=True)
            contents.append(
                f"<Contents><Key>{html.escape(key)}</Key><Size>{p.stat().st_size}</Size>"
                f'<LastModified>{when}</LastModified><ETag>"x"</ETag><StorageClass>STANDARD</StorageClass></Contents>'
            )
    return (
        '<?xml version="1.0" encoding="UTF-8"?><ListBucketResult><Name>b</Name>'
        f"<Prefix>{html.escape(prefix)}</Prefix><KeyCount>{len(contents) + len(prefixes)}</KeyCount>"
        f"<MaxKeys>1000</MaxKeys><IsTruncated>false</IsTruncated>{''.join(contents)}{''.join(prefixes)}"
        "</ListBucketResult>"
    ).encode()


@contextmanager
def serving(root: Path, ranges: bool = True) -> Iterator[Server]:
    """Serve ``root`` on a free loopback port for the block; always stopped after it."""
    server = Server(root, ranges)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
