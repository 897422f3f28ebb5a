"""Sharing unchanged bytes with the source instead of copying them, where the filesystem can.

On a copy-on-write filesystem (XFS with reflink, btrfs, bcachefs, ZFS 2.2) a range of one
file can be made to share another's blocks (``FICLONERANGE``): no byte is read or written
and no new block is used. The kernel does it only between offsets that agree modulo the
block, for whole blocks. So an output file's data area is made to start at the offset,
modulo BLOCK, that puts the most unchanged bytes in step with their source (its header
padded with spaces, as the format allows: ``line_up``), and each run of unchanged tensors
that continue one another in a source file (``spans``: a kept shard's whole data area) is
moved as a copied head up to the first block boundary, a shared middle, and a copied tail
(``copy_shared``). Whether the output's filesystem can share is probed once per run
(``Sharing.probe``); where it cannot, or where nothing long would line up, the layout is
left exactly as the reference writer's.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

from streamck.fileio import NO_CLONE, can_clone, clone_range
from streamck.plan import OutputTensor
from streamck.source.header import TensorRef
from streamck.source.reader import Reader
from streamck.storage import UrlPath
from streamck.writer.layout import Shard, pad_header

BLOCK = 4096  # the filesystems' block: offsets in step modulo this can share blocks
# A file's header is padded only when that shares at least this many bytes: tiny tensors
# are not worth a layout that differs from the reference writer's.
MIN_SHARED = 1 << 20
# Bytes shared per FICLONERANGE call: each is a bounded piece of work between progress
# updates and stop checks.
CLONE_CHUNK = 1 << 30


class Sharing:
    """Which source files an output can share blocks with: those on the output's own
    filesystem (same ``st_dev``), when that filesystem can share at all. A file whose
    first clone fails (a kernel that will not clone across mounts) is copied from then on."""

    def __init__(self, device: int | None):
        self.device = device
        self._paths: dict[Path, bool] = {}

    @classmethod
    def probe(cls, directory: Path) -> Sharing:
        """Probe once the filesystem of ``directory``, or of its nearest ancestor that
        exists, where the output's files will be made (streamck.fileio.can_clone)."""
        while not directory.is_dir() and directory != directory.parent:
            directory = directory.parent
        return cls(os.stat(directory).st_dev if can_clone(directory, BLOCK) else None)

    def may_share(self, t: OutputTensor) -> bool:
        """Whether ``t``'s bytes could be shared: unchanged, one run, in a file that can share."""
        return self.device is not None and one_run(t) and self.shares(t.source.path)

    def shares(self, path: Path) -> bool:
        """Whether ``path`` lies on the output's filesystem (and has not refused a clone)."""
        ok = self._paths.get(path)
        if ok is None and isinstance(path, UrlPath):  # a remote file shares nothing
            ok = self._paths[path] = False
        if ok is None:
            try:
                ok = os.stat(path).st_dev == self.device
            except OSError:
                ok = False
            self._paths[path] = ok
        return ok

    def refuse(self, path: Path) -> None:
        self._paths[path] = False


def one_run(t: OutputTensor) -> bool:
    """Whether ``t``'s bytes are its source's, unchanged, as one run of one file."""
    ref = t.source
    if t.is_cast or t.transform is not None:  # bytes computed here
        return False
    return ref.strides is None and ref.tiles is None and not ref.parts


def _middle(start: int, length: int) -> int:
    """The whole blocks of ``[start, start + length)``, counted from the first boundary."""
    head = -start % BLOCK
    return (length - head) // BLOCK * BLOCK if length > head else 0


def line_up(shard: Shard, sharing: Sharing, align: int) -> Shard:
    """``shard`` with its header padded so that its data area starts at the offset, modulo
    BLOCK, that puts the most shareable bytes in step with their source (a multiple of
    ``align``, the least padding on a tie); ``shard`` itself when its own start does as
    well, or when fewer than MIN_SHARED bytes would be shared."""
    if shard.format != "safetensors" or BLOCK % align:
        return shard
    gain: Counter[int] = Counter()
    offset = 0
    for group, span in spans(shard.tensors):
        if span is not None and sharing.may_share(group[0]):
            gain[(span.start - offset) % BLOCK] += _middle(span.start, span.nbytes)
        offset += sum(t.nbytes for t in group)
    size = len(shard.header)
    best = max((r for r in gain if r % align == 0), key=lambda r: (gain[r], -((r - size) % BLOCK)), default=None)
    if best is None or gain[best] < MIN_SHARED or gain[best] == gain[size % BLOCK]:
        return shard
    return replace(shard, header=pad_header(shard.header, size + (best - size) % BLOCK))


def _span(ref: TensorRef, start: int, length: int) -> TensorRef:
    """Bytes ``[start, start + length)`` of ``ref``'s file, as a plain byte tensor."""
    return TensorRef(ref.name, "U8", (length,), ref.path, start, start + length)


Group = tuple[list[OutputTensor], TensorRef | None]


def _joined(group: list[OutputTensor]) -> Group:
    first, last = group[0].source, group[-1].source
    return group, _span(first, first.start, last.end - first.start)


def _continues(before: TensorRef, ref: TensorRef) -> bool:
    """Whether ``ref``'s bytes follow ``before``'s in one file. The refs of one file share its
    Path object (read_header keeps it), so identity answers first: Path's own ``==`` compares
    parsed parts in Python, 0.17 s of a 92k-tensor copy (#44)."""
    return ref.start == before.end and (ref.path is before.path or ref.path == before.path)


def spans(tensors: list[OutputTensor]) -> Iterator[Group]:
    """``tensors`` in write order, grouped: each tensor whose bytes are one unchanged run
    (one_run) together with the ones after it that continue it in its source file, whatever
    their names, and their bytes as one span: one copy (or clone) for them all, so a kept
    shard's data area moves whole; any other tensor alone, with None."""
    group: list[OutputTensor] = []
    for t in tensors:
        if not one_run(t):
            if group:
                yield _joined(group)
                group = []
            yield [t], None
            continue
        if group and not _continues(group[-1].source, t.source):
            yield _joined(group)
            group = []
        group.append(t)
    if group:
        yield _joined(group)


def copy_shared(
    reader: Reader,
    ref: TensorRef,
    out: int,
    sharing: Sharing,
    progress: Callable[[int], None],
    shared_progress: Callable[[int], None],
) -> int:
    """Append the bytes of ``ref`` (one run) to ``out`` as ``reader.copy`` does, sharing the
    source's blocks for the whole-block middle where source and output offsets are in step.
    Copied bytes are counted by ``progress``, shared ones by ``shared_progress`` (they leave
    nothing for the disk to flush). Returns the bytes shared."""
    middle = _middle(ref.start, ref.nbytes)
    at = os.lseek(out, 0, os.SEEK_CUR) if middle else 0
    if not middle or (ref.start - at) % BLOCK or not sharing.shares(ref.path):
        reader.copy(ref, out, progress)
        return 0
    head = -ref.start % BLOCK
    if head:
        reader.copy(_span(ref, ref.start, head), out, progress)
    src, start, end = reader.fd(ref.path), ref.start + head, ref.start + head + middle
    shared = 0
    while start + shared < end:
        n = min(CLONE_CHUNK, end - start - shared)
        try:
            clone_range(src, start + shared, out, at + head + shared, n)
        except OSError as e:
            if e.errno not in NO_CLONE:
                raise
            sharing.refuse(ref.path)
            break
        shared += n
        os.lseek(out, at + head + shared, os.SEEK_SET)
        shared_progress(n)
    if start + shared < ref.end:
        reader.copy(_span(ref, start + shared, ref.end - start - shared), out, progress)
    return shared
