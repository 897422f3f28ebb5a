"""Native torch.distributed.checkpoint (``dcp.save`` + ``FileSystemWriter``), without torch.

``.metadata`` (streamck.source.dcp.metadata) names, for each chunk, a ``(file, offset,
length)`` range of a ``__R_I.distcp`` file that is a whole ``torch.save`` archive of that
chunk; a file may hold several chunks of one tensor (torchrec's ``LocalShardsWrapper``,
megatron-core). A chunk saved as a strided view (a ``channels_last`` conv weight, a
transposed matrix) is gathered like a ``.pt`` view. Non-tensor items
(``BytesStorageMetadata``) are skipped with a notice and never unpickled, unless the save
was made with ``flatten_state_dict=False``: then a nested dict is one such item, a
``torch.save`` archive whose tensors are read as a ``.pt`` file's are.

Files are opened through one bounded pool (streamck.source.reader), so a checkpoint of
thousands of files indexes under any descriptor limit.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import BinaryIO

from streamck.errors import CheckpointError, listing
from streamck.source.dcp.metadata import METADATA_FILE, Chunk, Location, Saved, read_metadata
from streamck.source.dcp.sharded import Entry, finish, select
from streamck.source.header import TensorRef
from streamck.source.reader import Reader
from streamck.source.runs import Tile
from streamck.source.torchzip.archive import flatten, load_archive, storage_starts, tensor_ref
from streamck.source.torchzip.unpickle import Lazy
from streamck.storage import UrlPath, location
from streamck.storage.local import FdSource
from streamck.storage.window import Window

__all__ = ["METADATA_FILE", "read_distcp"]


class Files:
    """The checkpoint's files through a Reader's bounded fd pool, each size taken once."""

    def __init__(self, pool: Reader):
        self.pool, self.sizes = pool, {}

    def blob(self, where: Location, what: str) -> BinaryIO:
        """The blob at ``where`` as a seekable file: a window on a pooled fd, or on a remote
        file read by ranges (a chunk's zip directory and pickle, a few requests)."""
        path = where.path
        if isinstance(path, UrlPath):
            if path not in self.sizes and not path.exists():
                raise CheckpointError("file named by .metadata is missing (a rank file?)", path)
            src = self.pool.remote(path)
            size = self.sizes[path] = src.size
        else:
            try:
                fd = self.pool.fd(path)
            except CheckpointError:
                if not path.exists():
                    raise CheckpointError("file named by .metadata is missing (a rank file?)", path) from None
                raise
            size = self.sizes.get(path)
            if size is None:
                size = self.sizes[path] = os.fstat(fd).st_size
        if where.offset + where.length > size:
            raise CheckpointError(
                f"{what}: bytes [{where.offset}, +{where.length}) run past the {size}-byte file", path
            )
        if isinstance(path, UrlPath):
            from streamck.storage.remote import open_file

            return open_file(src, where.offset, where.length)
        return Window(FdSource(fd, path), where.offset, where.length)


def _archive(files: Files, where: Location, what: str) -> tuple[object, dict[str, tuple[int, int]]]:
    """A blob's unpickled object and its storages' (absolute data start, size)."""
    window = files.blob(where, what)
    try:
        obj, storages, records, prefix = load_archive(window, where.path)
        starts = storage_starts(window, storages, records, prefix, where.path)
    except CheckpointError as e:
        raise CheckpointError(f"{what}: blob at byte {where.offset}: {e.message}", where.path) from None
    if any(start + size > where.length for start, size in starts.values()):
        raise CheckpointError(f"{what}: storage record runs past the blob", where.path)
    return obj, {k: (where.offset + start, size) for k, (start, size) in starts.items()}


def _chunk_ref(files: Files, name: str, dtype: str, chunk: Chunk) -> TensorRef:
    """The chunk's tensor in its blob: contiguous, or a strided view to gather."""
    what = f"tensor {name!r} chunk at {list(chunk.offsets)}"
    obj, starts = _archive(files, chunk.where, what)
    if not isinstance(obj, Lazy):
        raise CheckpointError(f"{what}: blob holds a {type(obj).__name__}, not a tensor", chunk.where.path)
    if obj.dtype != dtype:
        raise CheckpointError(f"{what}: blob holds {obj.dtype}, .metadata says {dtype}", chunk.where.path)
    if obj.size != chunk.sizes:
        raise CheckpointError(
            f"{what}: blob holds shape {list(obj.size)}, .metadata says {list(chunk.sizes)}", chunk.where.path
        )
    try:
        return tensor_ref(name, obj, starts[obj.storage.key], chunk.where.path)
    except CheckpointError as e:  # "tensor 'x': view runs past…", said of this chunk
        raise CheckpointError(f"{what}: {e.message.removeprefix(f'tensor {name!r}: ')}", chunk.where.path) from None


def _entry(files: Files, name: str, dtype: str, shape: tuple[int, ...], chunks: list[Chunk], md: Path) -> Entry:
    refs = [(c, _chunk_ref(files, name, dtype, c)) for c in chunks]
    strided = [(c, r) for c, r in refs if r.strides is not None]
    if strided and len(refs) == 1 and refs[0][0].sizes == shape:  # the whole tensor, a strided view
        ref = strided[0][1]
        return Entry(name, dtype, shape, (Tile(ref.path, ref.start, (0,) * len(shape), shape),), ref.strides)
    if strided:
        c, r = strided[0]
        raise CheckpointError(
            f"tensor {name!r} chunk at {list(c.offsets)}: a strided view (strides {list(r.strides)}) "
            "among several chunks; streamck gathers a strided chunk only when it is the whole tensor",
            r.path,
        )
    return finish(name, dtype, shape, [Tile(r.path, r.start, c.offsets, c.sizes) for c, r in refs], md)


def _disjoint(saved: Saved) -> None:
    """Refuse two blobs that share bytes of one file (a damaged or hand-edited .metadata)."""
    spans: dict[Path, list[tuple[int, int, str]]] = {}
    for name, item in saved.tensors.items():
        for c in item.chunks:
            spans.setdefault(c.where.path, []).append((c.where.offset, c.where.length, f"{name!r} {list(c.offsets)}"))
    for name, loc in saved.objects.items():
        if loc is not None:
            spans.setdefault(loc.path, []).append((loc.offset, loc.length, repr(name)))
    for path, found in spans.items():
        found.sort()
        for (a, n, x), (b, _, y) in itertools.pairwise(found):
            if b < a + n:
                raise CheckpointError(f"the chunks {x} and {y} share bytes [{b}, {a + n})", path)


# What a pickle of tensor subclasses (DTensor, ShardedTensor) rebuilds them through.
_SUBCLASS_REBUILDERS = ("_rebuild_from_type_v2", "_rebuild_wrapper_subclass", "torch.distributed")


def _why(name: str, refusal: str) -> str:
    if any(r in refusal for r in _SUBCLASS_REBUILDERS):
        return f"{name!r} holds DTensors or other tensor subclasses pickled whole, only the saving rank's shards"
    return f"{name!r}: {refusal}"


def _objects(files: Files, saved: Saved) -> tuple[list[Entry], list[str], list[str]]:
    """The non-tensor items: under flatten_state_dict=False, the tensors of the ones that
    are pickled dicts (read like a .pt file's); the names of the rest, and why none were read."""
    entries, skipped, why = [], [], []
    for name, loc in saved.objects.items():
        if saved.flattened or loc is None:
            skipped.append(name)
            continue
        try:
            obj, starts = _archive(files, loc, f"item {name!r}")
        except CheckpointError as e:
            skipped.append(name)
            why.append(_why(name, e.message))
            continue
        leaves = flatten({name: obj}, loc.path) if isinstance(obj, dict | list | tuple) else {name: obj}
        for leaf, value in leaves.items():
            if not isinstance(value, Lazy):
                skipped.append(leaf)
                continue
            ref = tensor_ref(leaf, value, starts[value.storage.key], loc.path)
            tiles = (Tile(ref.path, ref.start, (0,) * len(ref.shape), ref.shape),) if ref.numel else ()
            entries.append(Entry(leaf, ref.dtype, ref.shape, tiles, ref.strides))
    return entries, skipped, why


def read_distcp(directory: Path, key: str | None = None) -> tuple[dict[str, Entry], list[str]]:
    """Index a native DCP checkpoint directory (``.metadata`` or per-rank ``__R.metadata``,
    and ``*.distcp``) by tensor.

    ``key`` reads the items under that prefix alone (see streamck.source.dcp.sharded.select).
    Returns the entries in save-plan order and the notices: the top-level groups, one
    line per group of skipped non-tensor items, and, when no item is a tensor, why.
    """
    directory = location(directory)
    saved = read_metadata(directory)
    _disjoint(saved)
    with Reader() as pool:
        files = Files(pool)
        found, skipped, why = _objects(files, saved)
        nested = {e.name: e for e in found}
        clash = next((n for n in nested if n in saved.tensors), None)
        if clash is not None:
            raise CheckpointError(f"two items are named {clash!r} once nested keys are joined with dots", saved.where)
        chosen, notes = select([*saved.tensors, *nested], skipped, key, saved.where)
        entries: dict[str, Entry] = {}
        for name, out in chosen.items():
            item = saved.tensors.get(name)
            e = nested[name] if item is None else _entry(files, name, item.dtype, item.shape, item.chunks, saved.where)
            entries[out] = e._replace(name=out)
    if not entries and not saved.flattened:
        notes.append(
            "saved with flatten_state_dict=False, and no item is a pickled dict of plain tensors"
            + (f" ({listing(why, 2)})" if why else "")
        )
    return entries, notes
