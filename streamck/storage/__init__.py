"""Where checkpoint bytes live: a local path or a URL, read through one small interface.

Every reader of tensor bytes and headers asks ``open_source`` for a ``ByteSource`` (a size,
and whole reads at an offset) and ``stamp`` for what a file looks like now; a URL
(``s3://bucket/key``, any scheme fsspec knows) is a ``UrlPath``, so the rest of streamck
handles it as it handles a path: its name, parent, and ``root / name`` join. Remote files go
through fsspec (streamck.storage.remote), imported only when a URL is given; local ones
through the fds of streamck.storage.local. A remote output is written through
streamck.storage.upload: multipart uploads that appear only when completed. This package
imports nothing of streamck above its errors and raw fd helpers.
"""

from __future__ import annotations

import os
from typing import BinaryIO, Protocol

from streamck.storage.inflight import requests_in_flight
from streamck.storage.url import UrlPath, is_url, location

__all__ = [
    "ByteSource",
    "UrlPath",
    "is_url",
    "location",
    "open_file",
    "open_source",
    "requests_in_flight",
    "stamp",
]


class ByteSource(Protocol):
    """One file's bytes, read at any offset: ``readinto`` fills the whole view or raises a
    CheckpointError naming the file (a short file, a failed request)."""

    size: int

    def readinto(self, view: memoryview, offset: int) -> None: ...

    def close(self) -> None: ...


def open_source(path: os.PathLike) -> ByteSource:
    """A ByteSource on the file at ``path`` (a local path or a UrlPath). Raises OSError for
    a local file that cannot be opened, CheckpointError for a remote one."""
    if isinstance(path, UrlPath):
        from streamck.storage.remote import RemoteSource

        return RemoteSource.open(path)
    from streamck.storage.local import LocalSource

    return LocalSource(path)


def open_file(path: os.PathLike) -> BinaryIO:
    """A seekable binary file on ``path`` for readers of pickles and zip directories: a local
    file (OSError if it cannot be opened), or a remote one read by ranges (CheckpointError)."""
    if isinstance(path, UrlPath):
        from streamck.storage.remote import RemoteSource
        from streamck.storage.remote import open_file as remote_file

        return remote_file(RemoteSource.open(path), owned=True)
    return open(path, "rb")


def stamp(path: os.PathLike) -> tuple[int, int, int | str]:
    """What the file at ``path`` looks like now, to notice it changing under a reader: its
    size, modification time in ns and identity (a local file's inode, an object's ETag)."""
    if isinstance(path, UrlPath):
        from streamck.storage.remote import remote_stamp

        return remote_stamp(path)
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns, st.st_ino
