"""torch.distributed.checkpoint (DCP) checkpoints, without torch.

Two on-disk forms of one sharded state, both read down to ``Tile`` records
(streamck.source.runs): where each saved chunk's C-contiguous bytes are and which
block of the full tensor it is. This module reads the first and holds what both share;
streamck.source.dcp.native reads the second.

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

from streamck.errors import CheckpointError, Info, listing
from streamck.source.groups import ALL_KEY, is_state, model_group, model_note
from streamck.source.header import read_header
from streamck.source.runs import Tile, tiling_error
from streamck.source.serde import Invalid, no_duplicates
from streamck.storage import location, open_file

SHARDING_KEY = "DCP_SHARDING_INFO"
_SHARD_NAME = re.compile(r"shard-(\d+)-model-(\d+)-of-(\d+)\.safetensors")


class Entry(NamedTuple):
    """One tensor of a DCP checkpoint: its full dtype and shape, and the chunks covering it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    tiles: tuple[Tile, ...]  # sorted by offsets
    strides: tuple[int, ...] | None = None  # one tile, the whole tensor, a strided view (gathered)


def _common_dir(paths: list[Path]) -> Path:
    parents = {p.parent for p in paths}
    return parents.pop() if len(parents) == 1 else paths[0]


def int_tuple(value: object) -> tuple[int, ...] | None:
    if isinstance(value, (list, tuple)) and all(type(x) is int and x >= 0 for x in value):
        return tuple(value)
    return None


def finish(name: str, dtype: str, shape: tuple[int, ...], tiles: list[Tile], where: Path, extra: str = "") -> Entry:
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


def read_sharded_safetensors(paths: list[Path], key: str | None = None) -> tuple[dict[str, Entry], list[str]]:
    """Index DCP-sharded safetensors files (one per rank, every one of them) by tensor.

    Returns the entries, in the order their names first appear in the files'
    ``DCP_SHARDING_INFO`` (the save plan's order), and notices (the top-level groups; this
    format holds no non-tensor items). ``key`` reads the tensors under it (see select).
    """
    paths = [location(p) for p in paths]
    if not paths:
        raise CheckpointError("no sharded safetensors files given")
    _shard_indices(paths)
    chunks: dict[str, list[tuple[str, Tile]]] = {}
    for path in paths:
        _pickle_in_front(path)
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
            offsets = int_tuple(item.get("saved_offsets")) if isinstance(item, dict) else None
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
    chosen, notes = select(list(chunks), [], key, where)
    for name, parts in chunks.items():
        if name not in chosen:
            continue
        dtype, first = parts[0][0], parts[0][1]
        for d, t in parts[1:]:
            if d != dtype:
                raise CheckpointError(
                    f"tensor {name!r}: chunk at {list(t.offsets)} is {d}, the one in {first.path.name} {dtype}", t.path
                )
        tiles = [t for _, t in parts]
        shape = tuple(max(o + s for o, s in zip(*dims, strict=True)) for dims in _per_dim(tiles))
        entries[chosen[name]] = finish(name, dtype, shape, tiles, where)._replace(name=chosen[name])
    return entries, notes


def _pickle_in_front(path: Path) -> None:
    """Refuse a rank file that starts with a torch.save archive: torch's HuggingFaceStorageWriter
    writes a non-tensor item (a step counter) there, in front of the safetensors bytes."""
    with open_file(path) as f:
        if f.read(4) == b"PK\x03\x04":
            raise CheckpointError(
                "starts with a pickled non-tensor item, not a safetensors header: torch's "
                "HuggingFaceStorageWriter writes such items in front of the tensors; save only tensors through it",
                path,
            )


def _per_dim(tiles: list[Tile]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Per dimension: (every tile's offset, every tile's size)."""
    rank = len(tiles[0].sizes)
    for t in tiles:
        if len(t.sizes) != rank:
            raise CheckpointError(f"chunks of rank {rank} and {len(t.sizes)} for one tensor", t.path)
    return [(tuple(t.offsets[i] for t in tiles), tuple(t.sizes[i] for t in tiles)) for i in range(rank)]


# ---------------------------------------------------------------- top-level groups and --key


def _groups(names: list[str]) -> str:
    """The common dotted prefix of ``names`` under which they part ways ("" or "app.")."""
    prefix = ""
    while True:
        heads = {n[len(prefix) :].split(".", 1)[0] for n in names}
        if len(heads) != 1 or not all(n.startswith(prefix + next(iter(heads)) + ".") for n in names):
            return prefix
        prefix += next(iter(heads)) + "."


def _counts(tensors: list[str], others: list[str], prefix: str) -> dict[str, list[int]]:
    counts: dict[str, list[int]] = {}
    for i, names in enumerate((tensors, others)):
        for n in names:
            counts.setdefault(prefix + n[len(prefix) :].split(".", 1)[0], [0, 0])[i] += 1
    return counts


def _shown(counts: dict[str, list[int]]) -> str:
    def one(group: str, t: int, o: int) -> str:
        parts = [f"{t} tensor{'s' * (t > 1)}"] if t else []
        parts += [f"{o} other item{'s' * (o > 1)}"] if o else []
        return f"{group} {' + '.join(parts)}"

    return ", ".join(one(g, t, o) for g, (t, o) in counts.items())


def _weights_flag(counts: dict[str, list[int]]) -> str:
    """The flag that takes the model weights alone, or "" when the groups do not tell."""
    state = [g for g in counts if is_state(g)]
    weights = [g for g, (t, _) in counts.items() if t and g not in state]
    if not state or not weights:
        return ""
    if len(weights) == 1:
        return f"; --key {weights[0]} takes the weights alone"
    drops = " ".join(f"--drop '{g}.*'" for g in state if counts[g][0])  # torchtitan: model keys at the top
    return f"; rewrite {drops} leaves the weights" if drops else ""


def skipped_notes(names: list[str], prefix: str = "") -> list[str]:
    """One line per top-level group (under ``prefix``) of skipped non-tensor items, with a
    count: they need no action."""
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(prefix + n[len(prefix) :].split(".", 1)[0], []).append(n)
    return [
        Info(f"{g}: {len(ns)} non-tensor item{'s' * (len(ns) > 1)} skipped ({listing(ns, 4)})")
        for g, ns in groups.items()
    ]


def select(tensors: list[str], others: list[str], key: str | None, where: Path) -> tuple[dict[str, str], list[str]]:
    """Which tensors of a flattened state dict to read, and their names: with ``key``
    (``model``, ``app.model``) those under ``key.``, that prefix taken off; without it, the
    model group when it sits beside training state (streamck.source.groups, said in a note),
    else all of them, as with ``key`` ``*``. Also the notices: the top-level groups with
    their counts when there are several (and the flag that takes the weights alone), and
    the non-tensor items skipped, folded per group."""
    prefix = _groups(tensors + others) if tensors or others else ""
    counts = _counts(tensors, others, prefix)
    if key is None:
        group = model_group({g: t for g, (t, _) in counts.items()})
        if group is not None:
            chosen, left, notes = _under(tensors, others, group, prefix, counts, where)
            return chosen, [model_note(group, len(chosen), _shown(left)), *notes]  # kept under -q: what was left out
    if key is None or key == ALL_KEY:  # the groups are said when training state is among them: an action to take
        state = any(is_state(g) for g in counts)
        notes = [f"top-level groups: {_shown(counts)}{_weights_flag(counts)}"] if state and key is None else []
        return {n: n for n in tensors}, notes + skipped_notes(others, prefix)
    chosen, left, notes = _under(tensors, others, key, prefix, counts, where)
    return chosen, (
        [Info(f"--key {key}: {len(chosen)} tensors read; left out: {_shown(left)}")] if left else []
    ) + notes


def _under(
    tensors: list[str], others: list[str], key: str, prefix: str, counts: dict[str, list[int]], where: Path
) -> tuple[dict[str, str], dict[str, list[int]], list[str]]:
    """The tensors under ``key.`` (prefix taken off), the groups left out with their counts,
    and the notes on the skipped non-tensor items under ``key``."""
    head = key.rstrip(".") + "."
    chosen = {n: n[len(head) :] for n in tensors if n.startswith(head)}
    if not chosen:
        raise CheckpointError(f"no tensors under key {key!r}; top-level groups: {_shown(counts) or 'none'}", where)
    left = {g: c for g, c in counts.items() if not (g + ".").startswith(head) and not head.startswith(g + ".")}
    return chosen, left, skipped_notes([n for n in others if n.startswith(head)], prefix)
