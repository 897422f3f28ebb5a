"""torch.distributed.checkpoint (DCP) checkpoints, without torch.

Two on-disk forms of one sharded state, both read down to ``Tile`` records
(streamck.source.runs): where each saved chunk's C-contiguous bytes are and which
block of the full tensor it is. This module reads the first and holds what both share;
streamck.source.distcp reads the second.

* Sharded safetensors (``HuggingFaceStorageWriter(save_distributed=True)``, NeMo
  Automodel's ``model/`` dirs): one ``shard-SSSSS-model-CCCCC-of-NNNNN.safetensors``
  per rank, each tensor a chunk; ``__metadata__["DCP_SHARDING_INFO"]`` is JSON
  ``{fqn: {"saved_offsets": [...]}}``. No global index is written: the full shape is
  the per-dimension maximum of offset + size.
* Native DCP (``FileSystemWriter``): ``.metadata``, a pickle of torch's ``Metadata``
  (read here with an allow-list of stand-in classes, never importing torch), naming for
  each chunk a ``(file, offset, length)`` range of a ``__R_I.distcp`` file that is a whole
  ``torch.save`` zip archive of that chunk.

Non-tensor items (``BytesStorageMetadata``: step counters, RNG state…) are skipped with a
notice and never unpickled.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import NamedTuple

from streamck.errors import CheckpointError
from streamck.source.header import read_header
from streamck.source.runs import Tile, tiling_error
from streamck.source.serde import Invalid, no_duplicates

SHARDING_KEY = "DCP_SHARDING_INFO"
_SHARD_NAME = re.compile(r"shard-(\d+)-model-(\d+)-of-(\d+)\.safetensors")


class Entry(NamedTuple):
    """One tensor of a DCP checkpoint: its full dtype and shape, and the chunks covering it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    tiles: tuple[Tile, ...]  # sorted by offsets


def _common_dir(paths: list[Path]) -> Path:
    parents = {p.parent for p in paths}
    return parents.pop() if len(parents) == 1 else paths[0]


def _int_tuple(value: object) -> tuple[int, ...] | None:
    if isinstance(value, (list, tuple)) and all(type(x) is int and x >= 0 for x in value):
        return tuple(value)
    return None


def _finish(name: str, dtype: str, shape: tuple[int, ...], tiles: list[Tile], where: Path, extra: str = "") -> Entry:
    tiles.sort(key=lambda t: (t.offsets, str(t.path), t.start))
    err = tiling_error(shape, tiles)
    if err is not None:
        raise CheckpointError(f"tensor {name!r} {list(shape)}: {err}{extra}", where)
    return Entry(name, dtype, shape, tuple(tiles))


# ---------------------------------------------------------------- sharded safetensors


def _shard_indices(paths: list[Path]) -> None:
    """Refuse a set of ``shard-SSSSS-…`` files whose rank numbers (1-based) have a hole.

    A missing last rank cannot be seen: nothing records the world size.
    """
    found: dict[Path, set[int]] = {}
    for p in paths:
        m = _SHARD_NAME.fullmatch(p.name)
        if m is None:
            return  # not torch's naming: nothing to check
        found.setdefault(p.parent, set()).add(int(m.group(1)))
    for parent, ranks in found.items():
        missing = sorted(set(range(1, max(ranks) + 1)) - ranks)
        if missing:
            names = ", ".join(f"shard-{i:05d}-*" for i in missing[:4])
            raise CheckpointError(f"rank file {names} missing (have shards {sorted(ranks)})", parent)


def read_sharded_safetensors(paths: list[Path]) -> tuple[dict[str, Entry], list[str]]:
    """Index DCP-sharded safetensors files (one per rank, every one of them) by tensor.

    Returns the entries, in the order their names first appear in the files'
    ``DCP_SHARDING_INFO`` (the save plan's order), and notices (none for this format:
    torch's writer cannot store non-tensor items in safetensors).
    """
    paths = [p if isinstance(p, Path) else Path(p) for p in paths]
    if not paths:
        raise CheckpointError("no sharded safetensors files given")
    _shard_indices(paths)
    chunks: dict[str, list[tuple[str, Tile]]] = {}
    for path in paths:
        header = read_header(path)
        raw = header.metadata.get(SHARDING_KEY)
        if raw is None:
            raise CheckpointError(f"__metadata__ has no {SHARDING_KEY}: not a DCP-sharded safetensors file", path)
        try:
            info = json.loads(raw, object_pairs_hook=no_duplicates)
        except (ValueError, Invalid) as e:
            raise CheckpointError(f"{SHARDING_KEY} is not valid JSON: {e}", path) from None
        if not isinstance(info, dict):
            raise CheckpointError(f"{SHARDING_KEY} is JSON {type(info).__name__}, not an object", path)
        refs = {t.name: t for t in header.tensors}
        unlisted = [n for n in refs if n not in info]
        if unlisted:
            raise CheckpointError(f"tensor {unlisted[0]!r} has no entry in {SHARDING_KEY}", path)
        for name, item in info.items():
            ref = refs.get(name)
            if ref is None:
                raise CheckpointError(f"{SHARDING_KEY} names {name!r}, which the file does not hold", path)
            offsets = _int_tuple(item.get("saved_offsets")) if isinstance(item, dict) else None
            if offsets is None:
                raise CheckpointError(f"tensor {name!r}: saved_offsets {item!r:.80} is not a list of integers", path)
            if len(offsets) != len(ref.shape):
                raise CheckpointError(
                    f"tensor {name!r}: saved_offsets {list(offsets)} for a chunk of shape {list(ref.shape)}", path
                )
            if ref.strides is not None:  # safetensors never sets it; a guard for the NamedTuple contract
                raise CheckpointError(f"tensor {name!r}: chunk is not contiguous", path)
            chunks.setdefault(name, []).append((ref.dtype, Tile(path, ref.start, offsets, ref.shape)))
    entries: dict[str, Entry] = {}
    where = _common_dir(paths)
    for name, parts in chunks.items():
        dtype, first = parts[0][0], parts[0][1]
        for d, t in parts[1:]:
            if d != dtype:
                raise CheckpointError(
                    f"tensor {name!r}: chunk at {list(t.offsets)} is {d}, the one in {first.path.name} {dtype}", t.path
                )
        tiles = [t for _, t in parts]
        shape = tuple(max(o + s for o, s in zip(*dims, strict=True)) for dims in _per_dim(tiles))
        entries[name] = _finish(name, dtype, shape, tiles, where)
    return entries, []


def _per_dim(tiles: list[Tile]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Per dimension: (every tile's offset, every tile's size)."""
    rank = len(tiles[0].sizes)
    for t in tiles:
        if len(t.sizes) != rank:
            raise CheckpointError(f"chunks of rank {rank} and {len(t.sizes)} for one tensor", t.path)
    return [(tuple(t.offsets[i] for t in tiles), tuple(t.sizes[i] for t in tiles)) for i in range(rank)]
