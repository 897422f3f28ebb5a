"""A lazy index of every tensor in a checkpoint, built from shard headers alone."""

from __future__ import annotations

import os
from collections.abc import Iterable
from operator import itemgetter
from pathlib import Path

from streamck.errors import CheckpointError, Info, listing
from streamck.gcpause import paused
from streamck.source.crosscheck import cross_check
from streamck.source.dcp import fsdp, olmo
from streamck.source.header import Header, TensorRef, read_header
from streamck.source.index import Checkpoint, FileStamp, not_empty, tiled
from streamck.source.layout import Layout, bare_run_root, find_layout
from streamck.source.steps import pick_step
from streamck.source.tied import tied_kept, untie, untie_fsdp
from streamck.source.torchzip.archive import TORCH_SUFFIXES, read_torch_zip
from streamck.storage import UrlPath, location, open_file


def _also_in(name: str, tensors: dict[str, TensorRef], shard: Path) -> CheckpointError:
    """``shard`` holds ``name`` again, after the shard it was first read from."""
    return CheckpointError(f"tensor {name!r} is also in {tensors[name].path.name}", shard)


def _map_error(
    layout: Layout, tensors: dict[str, TensorRef], shard: Path | None = None, names: list[str] = ()
) -> CheckpointError:
    """What is wrong between the index's weight_map and the shards (known to disagree):
    in ``shard`` just read, holding ``names``, or, after all shards, anywhere."""
    if shard is not None:
        missing = [n for n in names if n not in layout.weight_map]
        if missing:
            shown = listing([repr(n) for n in missing], 5)
            return CheckpointError(f"shard tensors missing from weight_map: {shown}", layout.index)
        name = next(n for n in names if layout.weight_map[n] not in layout.spellings[shard])
        if name in tensors:
            return _also_in(name, tensors, shard)
        return CheckpointError(
            f"weight_map puts {name!r} in {layout.weight_map[name]}, but it is in {shard.relative_to(layout.root)}",
            layout.index,
        )
    for name, shard_name in layout.weight_map.items():
        ref = tensors.get(name)
        if ref is None:
            return CheckpointError(f"weight_map puts {name!r} in {shard_name}, which does not hold it", layout.index)
    raise AssertionError("weight_map and shards agree")


def open_checkpoint(
    path: str | os.PathLike,
    step: str | int | None = None,
    key: str | None = None,
    zero: bool = False,
    keep_tied: bool = False,
) -> Checkpoint:
    """Index the checkpoint at ``path`` from its headers, without reading tensor data.

    ``path`` may be one ``.safetensors`` file or torch zip (``.bin``/``.pt``), a
    directory with ``model.safetensors.index.json`` or ``pytorch_model.bin.index.json``
    and its shards, a directory of ``*.safetensors`` or ``pytorch_model*.bin`` shards,
    a step directory whose weights are in ``model/consolidated``, or, with ``step``
    (a number or ``"latest"``), a run root of step folders (streamck.source.steps.STEP_DIRS);
    a run root that marks its latest step is read at that step when ``step`` is None.
    In a torch pickle, nested dicts and lists are read with dotted names (``sub.x``,
    ``lst.0``); ``key`` reads only the dict under that top-level key (see read_torch_zip),
    and in a DCP checkpoint only the items under that dotted prefix (``model``,
    ``app.model``), the prefix taken off (see streamck.source.dcp.sharded.select).
    DCP checkpoints (sharded safetensors, ``.distcp``), Automodel steps and DeepSpeed
    ZeRO checkpoints (``checkpoint-N/``, ``global_stepN/``) are consolidated on the fly.
    Where a weights file and ZeRO state are both there, the weights are read unless
    ``zero``, or unless the file holds no tensors or size-0 placeholders (ZeRO-3's): then
    every tensor comes from the ZeRO state. A ZeRO checkpoint whose ``config.json`` says
    ``tie_word_embeddings`` leaves its tied output head out, as ``save_pretrained`` does,
    unless ``keep_tied``.
    Raises CheckpointError for anything malformed.
    """
    path = location(path)
    if isinstance(path, UrlPath):  # listings fsspec kept from an earlier open may miss a new step
        from streamck.storage.remote import forget

        forget(path)
    path, picked = resolve_step(path, step)
    with paused():
        try:
            ckpt = _index(path, key, zero, keep_tied)
        except OSError as e:  # stat or open of a path we may not enter or read
            raise CheckpointError(f"cannot read: {e.strerror}", e.filename or path) from None
    ckpt.notices[:0] = picked
    return ckpt


def resolve_step(path: Path, step: str | int | None) -> tuple[Path, list[Info]]:
    """The folder to read for ``path`` and ``step``: a run root's step (``latest`` too, and
    implied where the run marks it and no ``--step`` is given), else ``path``; with a note
    saying which step was picked, for the user to see."""
    if step is None and bare_run_root(path):
        step = "latest"
    if step is None:
        return path, []
    picked, why = pick_step(path, step)
    return picked, [Info(why)]


def _read_shard(path: Path, select: str | None, notices: list[str]) -> Header:
    """One shard's tensors; ``select`` is open_checkpoint's ``key``."""
    if path.suffix in TORCH_SUFFIXES:
        return read_torch_zip(path, select, notices)
    if path.suffix != ".safetensors":
        with open_file(path) as f:  # any other name: the first bytes decide
            if f.read(4) == b"PK\x03\x04":
                return read_torch_zip(path, select, notices)
    ignored = f"key {select!r} ignored: safetensors files hold no nested dicts"
    if select is not None and ignored not in notices:
        notices.append(ignored)
    return read_header(path)


def _shard_headers(
    shards: list[Path], select: str | None, notices: list[str]
) -> Iterable[tuple[Path, FileStamp, Header]]:
    """Each shard with its stamp, taken before its header is read (a change while we read
    shows too), and its header, in order; a remote checkpoint's a few shards at once (each
    is two requests' round trips: its length, then its header)."""

    def one(shard: Path) -> tuple[Path, FileStamp, Header]:
        stamp = FileStamp.of(shard)
        return shard, stamp, _read_shard(shard, select, notices)

    if not any(isinstance(s, UrlPath) for s in shards):
        return map(one, shards)
    from concurrent.futures import ThreadPoolExecutor

    from streamck.storage.remote import concurrency

    with ThreadPoolExecutor(concurrency(), thread_name_prefix="streamck-header") as pool:
        return list(pool.map(one, shards))


def _index_distributed(path: Path, layout: Layout, key: str | None) -> Checkpoint:
    """A DCP checkpoint: each tensor's chunks as tiles; with ``key``, the items under it."""
    from streamck.source.dcp import native, sharded

    files = {shard: FileStamp.of(shard) for shard in layout.shards}  # before reading: changes show
    if layout.kind == "fsdp":
        entries, notices = fsdp.read_fsdp(layout.root)
    elif layout.kind == "distcp":
        entries, notices = native.read_distcp(layout.root, key)
        notices += olmo.left_beside(layout.root)
    else:
        entries, notices = sharded.read_sharded_safetensors(layout.shards, key)
    tensors, paths = tiled(entries, layout.root)
    files |= {p: FileStamp.of(p) for p in paths if p not in files}
    cross_check(layout.side_root or layout.root, tensors)
    return Checkpoint(path, layout.root, tensors, {}, files, [*layout.notes, *notices], layout.side_root)


_name = itemgetter(0)  # TensorRef.name, at C speed


def _index(path: Path, select: str | None = None, zero: bool = False, keep_tied: bool = False) -> Checkpoint:
    layout = find_layout(path)
    if layout.kind == "zero" or (zero and layout.zero is not None):
        found = untie(*_index_zero(path, layout.zero or layout.root, layout.side_root or layout.root), keep_tied)
        return not_empty(found, "DeepSpeed ZeRO")
    if layout.kind == "verl":
        from streamck.source.verl.fsdp import index_verl

        return index_verl(path, layout.root, select, keep_tied)
    if zero:
        raise layout.zero_unclear or CheckpointError("{zero} given, but there is no DeepSpeed ZeRO state here", path)
    if layout.kind == "fsdp":
        if select not in (None, fsdp.MODEL_KEY):
            raise CheckpointError(f"{{key}} {select}: an FSDP model folder is read as its one item, 'model'", path)
        return untie_fsdp(not_empty(_index_distributed(path, layout, None), "FSDP"), keep_tied)
    if layout.kind != "files":
        return tied_kept(not_empty(_index_distributed(path, layout, select), "DCP"), keep_tied)
    tensors: dict[str, TensorRef] = {}
    metadata: dict[str, str] = {}
    files: dict[Path, FileStamp] = {}
    notices: list[str] = list(layout.notes)
    for shard, files[shard], header in _shard_headers(layout.shards, select, notices):
        for key, value in header.metadata.items():
            metadata.setdefault(key, value)
        names = list(map(_name, header.tensors))
        if layout.weight_map is None:
            if not tensors.keys().isdisjoint(names):
                name = next(n for n in names if n in tensors)
                raise _also_in(name, tensors, shard)
        # Each of this shard's tensors is mapped to this shard (one C-level pass), so
        # none is in another shard too...
        elif not set(map(layout.weight_map.get, names)) <= layout.spellings[shard]:
            raise _map_error(layout, tensors, shard, names)
        tensors.update(zip(names, header.tensors, strict=True))
    # ...and the map names nothing else: then it is exact.
    if layout.weight_map is not None and len(layout.weight_map) != len(tensors):
        raise _map_error(layout, tensors)
    if layout.zero_unclear is not None:
        if not tensors or not all(t.numel for t in tensors.values()):
            raise layout.zero_unclear  # placeholders, and the ZeRO state to read instead is a guess
        notices.append(f"the ZeRO state beside the weights is not read: {layout.zero_unclear}")
    if layout.zero is not None:
        empty = [n for n, t in tensors.items() if not t.numel]
        found = _placeholders(path, layout, tensors, empty, keep_tied) if not tensors or empty else None
        if found is not None:
            return not_empty(found, "DeepSpeed ZeRO")
        rel = _rel(layout.zero, layout.root)
        notices.append(f"DeepSpeed ZeRO state is here too ({rel}): --zero reads its fp32 master weights instead")
    found = Checkpoint(path, layout.root, tensors, metadata, files, notices, layout.side_root)
    if not fsdp.full_alone(layout.shards):
        return tied_kept(found, keep_tied)
    found.notices.extend(fsdp.left_beside(layout.root, fsdp.FULL_FILE))
    return untie_fsdp(found, keep_tied)


def _rel(path: Path, root: Path) -> Path:
    return path.relative_to(root) if path.is_relative_to(root) else path


def _placeholders(
    path: Path, layout: Layout, tensors: dict[str, TensorRef], empty: list[str], keep_tied: bool
) -> Checkpoint | None:
    """The ZeRO state, for a weights file beside it that holds no tensors, or size-0 tensors
    where the ZeRO state holds the parameter with elements: placeholders (what rank 0's
    ``save_pretrained`` writes under ZeRO-3 for every parameter above
    ``stage3_param_persistence_threshold``). Every tensor then comes from the ZeRO state,
    never a mix of the two. None when the size-0 tensors are parameters with no elements."""
    found, aliases = _index_zero(path, layout.zero, layout.root)
    what = layout.index or layout.shards[0]
    rel = _rel(layout.zero, layout.root)
    if not tensors:
        found.notices.insert(0, f"{what.name} holds no tensors: reading every tensor from the ZeRO state in {rel}")
        return untie(found, aliases, keep_tied)
    unknown = [n for n in empty if n not in found.tensors]
    if unknown:
        shown = listing([repr(n) for n in unknown], 3)
        raise CheckpointError(
            f"size-0 tensors {shown} are not in the ZeRO state in {rel}: not ZeRO-3 placeholders, "
            "and not the model (pass {zero} to read the ZeRO state alone)",
            what,
        )
    held = [n for n in empty if found.tensors[n].numel]
    if not held:
        return None
    found.notices.insert(
        0,
        f"{what.name} holds {len(held)} size-0 placeholders ({listing(held, 3)}; ZeRO-3 saves them so): "
        f"reading every tensor from the ZeRO state in {rel}",
    )
    return untie(found, aliases, keep_tied)


def _index_zero(path: Path, step_dir: Path, side_root: Path) -> tuple[Checkpoint, dict[str, str]]:
    """A DeepSpeed ZeRO checkpoint: every parameter's fp32 master weights, its fragments
    (one per rank file) as tiles over its flattened elements, tied aliases under every
    name; and those aliases (alias → the name it ties to)."""
    from streamck.source.zero.read import read_zero

    entries, aliases, notices = read_zero(step_dir)
    if step_dir != path and not (path / "latest").exists():  # a step folder chosen for the user
        notices.insert(0, f"no 'latest' file in {step_dir.parent.name}: reading its one ZeRO step, {step_dir.name}")
    tensors, paths = tiled(entries, step_dir)
    files = {p: FileStamp.of(p) for p in paths}
    return Checkpoint(path, step_dir, tensors, {}, files, notices, side_root), aliases
