"""Per-tensor digests of a checkpoint, streamed through hashlib in bounded memory."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from typing import Any

from streamck.gcpause import paused
from streamck.manifest import build_manifest
from streamck.source import Checkpoint
from streamck.source.header import TensorRef
from streamck.source.reader import Reader
from streamck.storage import UrlPath, open_source

ALGORITHM = "sha256"


BATCH = 1 << 20  # bytes of small neighbouring tensors read in one call


def tensor_digests(checkpoint: Checkpoint, names: list[str] | None = None) -> dict[str, str]:
    """The sha256 hex digest of every tensor's bytes (or of ``names`` only), in that order.
    Small tensors that lie one after another in a file are read together (batches), not
    with a read each: 92k reads for DeepSeek-V3's tensors, most of them a few bytes (#44)."""
    order = list(names if names is not None else checkpoint.tensors)
    digests: dict[str, str] = {}
    with Reader() as reader:
        for group in batches([(n, checkpoint.tensors[n]) for n in order]):
            if len(group) == 1:
                h = hashlib.new(ALGORITHM)
                for piece in reader.windows(group[0][1]):
                    h.update(piece)
                digests[group[0][0]] = h.hexdigest()
                continue
            first, end = group[0][1], group[-1][1].end
            data = memoryview(
                reader.read(TensorRef(first.name, "U8", (end - first.start,), first.path, first.start, end))
            )
            for name, ref in group:
                piece = data[ref.start - first.start : ref.end - first.start]
                digests[name] = hashlib.new(ALGORITHM, piece).hexdigest()
    return {n: digests[n] for n in order}


def _plain(ref: TensorRef) -> bool:
    """Whether ``ref``'s bytes are one run of its file, as stored."""
    return ref.strides is None and ref.tiles is None and not ref.parts


Named = tuple[str, TensorRef]


def batches(refs: list[Named], limit: int = BATCH) -> Iterator[list[Named]]:
    """``refs`` (name, ref) in file order, grouped: plain ones (one run each) that follow one
    another in one file, together at most ``limit`` bytes; any other alone."""
    group: list[Named] = []
    # By the path object's identity (one per file, shared by its refs), not its text: only
    # neighbours are joined, and the digests come back in the caller's order.
    for name, ref in sorted(refs, key=lambda r: (id(r[1].path), r[1].start)):
        alone = not _plain(ref) or ref.nbytes > limit
        if group and (alone or not _continues(group, ref, limit)):
            yield group
            group = []
        if alone:
            yield [(name, ref)]
        else:
            group.append((name, ref))
    if group:
        yield group


def _continues(group: list[Named], ref: TensorRef, limit: int) -> bool:
    """Whether plain ``ref`` follows ``group`` in its file and fits in its batch."""
    last = group[-1][1]
    same = ref.path is last.path or ref.path == last.path
    return same and ref.start == last.end and ref.end - group[0][1].start <= limit


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
    with paused():  # a digest and a few dicts per tensor (see streamck.gcpause)
        digests = tensor_digests(checkpoint)
        rows = ((t.name, t.dtype, t.shape, t.nbytes) for t in checkpoint.tensors.values())
        manifest = build_manifest(rows, checkpoint.metadata, {n: {ALGORITHM: d} for n, d in digests.items()})
    return {**manifest, "files": file_digests(checkpoint)}
