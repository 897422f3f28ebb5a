"""Per-tensor digests of a checkpoint, streamed through hashlib in bounded memory."""

from __future__ import annotations

import hashlib
import os
from typing import Any

from streamck.manifest import build_manifest
from streamck.source import Checkpoint
from streamck.source.reader import Reader
from streamck.storage import UrlPath, open_source

ALGORITHM = "sha256"


def tensor_digests(checkpoint: Checkpoint, names: list[str] | None = None) -> dict[str, str]:
    """The sha256 hex digest of every tensor's bytes (or of ``names`` only)."""
    digests = {}
    with Reader() as reader:
        for name in names if names is not None else checkpoint.tensors:
            h = hashlib.new(ALGORITHM)
            for piece in reader.windows(checkpoint.tensors[name]):
                h.update(piece)
            digests[name] = h.hexdigest()
    return digests


def file_digests(checkpoint: Checkpoint) -> dict[str, dict[str, Any]]:
    """The ``sha256`` and ``size`` of each file the checkpoint's tensors are read from, by its
    path relative to the checkpoint's root: what ``sha256sum`` prints, the Hub's LFS oid."""
    found = {}
    for path in sorted(checkpoint.files, key=str):
        if isinstance(path, UrlPath):
            digest, size = _remote_digest(path)
            found[str(path.relative_to(checkpoint.root))] = {ALGORITHM: digest, "size": size}
            continue
        with open(path, "rb") as f:
            digest = hashlib.file_digest(f, ALGORITHM).hexdigest()
            size = os.fstat(f.fileno()).st_size
        found[os.path.relpath(path, checkpoint.root)] = {ALGORITHM: digest, "size": size}
    return found


def _remote_digest(path: UrlPath, piece: int = 16 << 20) -> tuple[str, int]:
    """A remote file's digest and size, read in ranged pieces (streamck.storage)."""
    src = open_source(path)
    try:
        h, buf = hashlib.new(ALGORITHM), bytearray(piece)
        for at in range(0, src.size, piece):
            view = memoryview(buf)[: min(piece, src.size - at)]
            src.readinto(view, at)
            h.update(view)
        return h.hexdigest(), src.size
    finally:
        src.close()


def hash_manifest(checkpoint: Checkpoint) -> dict[str, Any]:
    """The checkpoint's manifest with a ``sha256`` field in every tensor entry, and its
    files' digests under ``files`` (file_digests)."""
    digests = tensor_digests(checkpoint)
    rows = ((t.name, t.dtype, t.shape, t.nbytes) for t in checkpoint.tensors.values())
    manifest = build_manifest(rows, checkpoint.metadata, {n: {ALGORITHM: d} for n, d in digests.items()})
    return {**manifest, "files": file_digests(checkpoint)}
