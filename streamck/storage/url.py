"""URLs spelled as paths: what lets a remote checkpoint's files be handled as local ones are."""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
HTTP = ("http", "https")


def is_url(text: object) -> bool:
    """Whether ``text`` is a URL (``scheme://...``) rather than a local path; a UrlPath is."""
    if isinstance(text, UrlPath):
        return True
    return isinstance(text, str | os.PathLike) and not isinstance(text, Path) and bool(_SCHEME.match(os.fspath(text)))


class UrlPath(PurePosixPath):
    """A URL as a pure path: ``s3://bucket/dir/model.safetensors`` has the name
    ``model.safetensors``, the parent ``s3://bucket/dir``, and ``parent / name`` gives it back.
    The path machinery stores it as ``s3:/bucket/...`` (one slash: a path has no empty part);
    ``str`` puts the second slash back. Nothing about it touches the local filesystem."""

    def __str__(self) -> str:
        text = super().__str__()
        scheme, sep, rest = text.partition(":/")
        return f"{scheme}://{rest}" if sep and "/" not in scheme else text

    def __repr__(self) -> str:
        return f"UrlPath({str(self)!r})"

    @property
    def scheme(self) -> str:
        return self.parts[0].rstrip(":")

    @property
    def key(self) -> str:
        """The URL as fsspec names it: without its scheme (``bucket/dir/file``), except over
        HTTP(S), whose filesystem takes the whole URL (a host alone is no URL to it)."""
        rest = "/".join(self.parts[1:])
        return f"{self.scheme}://{rest}" if self.scheme in HTTP else rest

    # What the readers of layouts and side files ask of a path, asked of the server
    # (streamck.storage.remote): each from its folder's listing, one request that fsspec
    # keeps, so that the dozens of questions a layout asks of a folder cost one request.
    def exists(self) -> bool:
        from streamck.storage.remote import entry

        return entry(self) is not None

    def is_file(self) -> bool:
        from streamck.storage.remote import entry

        return (entry(self) or {}).get("type") == "file"

    def is_dir(self) -> bool:
        from streamck.storage.remote import entry

        return (entry(self) or {}).get("type") == "directory"

    def is_symlink(self) -> bool:
        return False

    def resolve(self) -> UrlPath:
        """Itself: a URL has no links to follow (a synced ``LATEST`` link is a folder)."""
        return self

    def glob(self, pattern: str) -> Iterator[UrlPath]:
        """The entries of this folder whose names match ``pattern`` (one level: no ``/``, no ``**``)."""
        if "/" in pattern or "**" in pattern:
            raise ValueError(f"UrlPath.glob takes one level's pattern, not {pattern!r}")
        from streamck.storage.remote import listdir

        return iter([self / name for name in sorted(listdir(self)) if fnmatch.fnmatchcase(name, pattern)])

    def iterdir(self) -> Iterator[UrlPath]:
        from streamck.storage.remote import listdir

        return iter([self / name for name in sorted(listdir(self))])

    def read_bytes(self) -> bytes:
        from streamck.storage.remote import read_bytes

        return read_bytes(self)

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)


def location(text: str | os.PathLike) -> Path | UrlPath:
    """``text`` as a UrlPath when it is a URL (a ``file://`` URL is its local path), else a Path."""
    if isinstance(text, Path | UrlPath):
        return text
    raw = os.fspath(text)
    if not is_url(raw):
        return Path(raw)
    if raw.startswith("file://"):
        return Path(raw[len("file://") :])
    return UrlPath(raw.rstrip("/"))
