"""Per-tensor digests of a checkpoint, streamed through hashlib in bounded memory."""

from __future__ import annotations

import hashlib
from typing import Any

from streamck.manifest import build_manifest
from streamck.source import Checkpoint
from streamck.source.reader import Reader

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


def hash_manifest(checkpoint: Checkpoint) -> dict[str, Any]:
    """The checkpoint's manifest with a ``sha256`` field in every tensor entry."""
    digests = tensor_digests(checkpoint)
    rows = ((t.name, t.dtype, t.shape, t.nbytes) for t in checkpoint.tensors.values())
    return build_manifest(rows, checkpoint.metadata, {n: {ALGORITHM: d} for n, d in digests.items()})
