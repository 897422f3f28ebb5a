"""verl FSDP actor checkpoints (verl 0.9.1's ``FSDPCheckpointManager``), consolidated on the fly.

``global_step_N/actor/`` holds one ``model_world_size_W_rank_R.pt`` per rank (DTensors pickled
whole: streamck.source.verl.ranks), ``optim_…`` and ``extra_state_…`` per rank,
``fsdp_config.json`` (``{"FSDP_version": 1|2, "world_size": W}``) and ``huggingface/`` (config,
tokenizer). Beside the actor, the trainer writes ``global_step_N/data.pt`` (the dataloader) and,
in the run root, ``latest_checkpointed_iteration.txt``.

Each DTensor's shards are the blocks of ``torch.chunk`` (what DTensor's ``Shard(d)`` cuts:
``ceil(n / mesh size)`` rows each, the last ones shorter or empty), placed by the rank's
coordinate on the mesh; FSDP2's last rank pickles its padded storage, so the local shape, never
the storage's size, says what is real. ``Replicate`` (the ``ddp`` dimension of an HSDP
``("ddp", "fsdp")`` mesh) is read from the ranks at coordinate 0 there, as verl's merger does.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import NamedTuple

import orjson

from streamck.errors import CheckpointError, Info, listing
from streamck.source.runs import Tile, tiling_error
from streamck.source.torchzip.unpickle import TORCH_DTYPES
from streamck.source.verl.ranks import DTensor, RankState, read_rank

RANK_FILE = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")
CONFIG = "fsdp_config.json"
HF_DIR = "huggingface"
# What the actor folder and its step hold beside the model, never read, with what each is.
LEFT_OUT = (
    ("optim_world_size_*_rank_*.pt", "optimizer state"),
    ("extra_state_world_size_*_rank_*.pt", "scheduler, RNG"),
)


class Entry(NamedTuple):
    """One consolidated tensor: its blocks as tiles over its full shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    tiles: tuple[Tile, ...]


def actor_dir(path: Path) -> Path | None:
    """The actor folder for ``path``: itself when it holds verl rank files or ``fsdp_config.json``,
    else its ``actor/`` (``global_step_N/`` given); None when neither."""
    for d in (path, path / "actor"):
        if (d / CONFIG).is_file() or any(RANK_FILE.match(p.name) for p in d.glob("model_world_size_*_rank_*.pt")):
            return d
    return None


def rank_file_error(path: Path) -> CheckpointError | None:
    """The error for one verl rank file given alone: the model is every rank's file together."""
    if not RANK_FILE.match(path.name) or not (path.parent / CONFIG).is_file():
        return None
    return CheckpointError(f"one rank's file of a verl actor checkpoint: give its folder, {path.parent}", path)


def world_size(actor: Path) -> int:
    """``fsdp_config.json``'s world size (raises CheckpointError if missing or malformed)."""
    where = actor / CONFIG
    try:
        config = orjson.loads(where.read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"no {CONFIG}: the world size of these rank files is unknown", actor) from None
    except orjson.JSONDecodeError as e:
        raise CheckpointError(f"not valid JSON ({e})", where) from None
    world = config.get("world_size") if isinstance(config, dict) else None
    if type(world) is not int or world < 1:
        raise CheckpointError(f"world_size is {world!r}, not a positive integer", where)
    return world


def rank_files(actor: Path, world: int) -> list[Path]:
    """The W model rank files, in rank order; a missing one, or one of another world size or
    rank, is an error naming it."""
    found = sorted(p for p in actor.iterdir() if RANK_FILE.match(p.name))
    for p in found:
        w, r = map(int, RANK_FILE.match(p.name).groups())
        if w != world or r >= world:
            what = f"world size {w}" if w != world else f"rank {r}"
            raise CheckpointError(f"extra rank file: {what}, but {CONFIG} says world_size {world}", p)
    want = [actor / f"model_world_size_{world}_rank_{r}.pt" for r in range(world)]
    missing = [p.name for p in want if not p.is_file()]
    if missing:
        raise CheckpointError(f"rank file {listing(missing, 3)} missing ({CONFIG}: world_size {world})", actor)
    return want


def _placement(p: object, where: str, path: Path) -> int | None:
    """A placement's tensor dimension (``Shard(d)``), None for ``Replicate``; anything else refused."""
    kind = type(p).__name__
    state = getattr(p, "state", None) or {}
    if kind == "Replicate":
        return None
    if kind == "Shard" and type(state.get("dim")) is int and state["dim"] >= 0:
        return state["dim"]
    raise CheckpointError(f"{where}: placement {kind} is not read (only Shard and Replicate)", path)


class _Spec(NamedTuple):
    shape: tuple[int, ...]
    dtype: str
    dims: tuple[int | None, ...]  # per mesh dimension: the tensor dimension cut, or None (Replicate)
    coords: tuple[int, ...]  # this rank's coordinate on each mesh dimension
    names: tuple[str, ...]


def _spec(t: DTensor, where: str, path: Path) -> _Spec:
    """What a DTensor's spec says, checked for the shapes and types a real spec has."""
    state = getattr(t.spec, "state", None) or {}
    meta, mesh = state.get("tensor_meta"), state.get("mesh")
    margs = getattr(meta, "args", ())
    mstate = getattr(mesh, "state", None) or {}
    coords, names = mstate.get("_coordinate_on_dim"), mstate.get("_mesh_dim_names") or ()
    placements = state.get("placements")
    ok = (
        len(margs) == 3
        and isinstance(margs[0], tuple)
        and all(type(d) is int and d >= 0 for d in margs[0])
        and margs[2] in TORCH_DTYPES.values()
        and isinstance(coords, tuple)
        and all(type(c) is int and c >= 0 for c in coords)
        and isinstance(placements, tuple)
        and len(placements) == len(coords)
    )
    if not ok:
        raise CheckpointError(f"{where}: a DTensor spec of an unknown form (torch version?)", path)
    dims = tuple(_placement(p, where, path) for p in placements)
    cut = [d for d in dims if d is not None]
    if len(set(cut)) != len(cut) or any(d >= len(margs[0]) for d in cut):
        raise CheckpointError(f"{where}: placements {dims} cut one dimension twice or past the tensor's", path)
    return _Spec(margs[0], margs[2], dims, coords, tuple(map(str, names)))


def _tile(name: str, spec: _Spec, sizes: tuple[int, ...], t: DTensor, path: Path) -> Tile | None:
    """This rank's block of ``name`` (None when it holds none), checked against torch.chunk's."""
    offsets, want = [0] * len(spec.shape), list(spec.shape)
    for d, c, n in zip(spec.dims, spec.coords, sizes, strict=True):
        if d is not None:
            step = -(-spec.shape[d] // n)
            offsets[d] = min(c * step, spec.shape[d])
            want[d] = max(0, min(step, spec.shape[d] - offsets[d]))
    local = t.local
    if tuple(want) != local.shape or local.dtype != spec.dtype:
        got = f"{list(local.shape)} {local.dtype}"
        raise CheckpointError(f"{name!r}: local shard is {got}, torch.chunk's is {want} {spec.dtype}", path)
    if local.strides is not None:
        raise CheckpointError(f"{name!r}: the local shard is a non-contiguous view", path)
    return Tile(path, local.start, tuple(offsets), local.shape) if math.prod(local.shape) else None


def _mesh_sizes(ranks: list[RankState], world: int) -> tuple[int, ...]:
    """Each mesh dimension's size: the coordinates the rank files hold there (all files are here);
    their product must be the world size."""
    found: dict[int, tuple] = {}
    for rs in ranks:
        t = next((v for v in rs.items.values() if isinstance(v, DTensor)), None)
        if t is not None:
            found[len(found)] = _spec(t, "the first DTensor", rs.path).coords
    if not found:
        return ()
    sizes = tuple(max(c) + 1 for c in zip(*found.values(), strict=True))
    if math.prod(sizes) != world or len(set(found.values())) != len(found):
        raise CheckpointError(f"the rank files' mesh coordinates do not make a mesh of {world} ranks", ranks[0].path)
    return sizes


def consolidate(ranks: list[RankState], world: int) -> tuple[dict[str, Entry], list[str]]:
    """Every tensor of the model, its blocks from every rank file, in rank 0's order; and the
    names of entries that are not tensors."""
    first = ranks[0]
    for rs in ranks[1:]:
        if rs.items.keys() != first.items.keys():
            odd = next(iter(rs.items.keys() ^ first.items.keys()))
            raise CheckpointError(f"holds other names than rank 0's file (e.g. {odd!r})", rs.path)
    sizes = _mesh_sizes(ranks, world)
    entries, skipped = {}, []
    for name, v in first.items.items():
        if isinstance(v, DTensor):
            spec0 = _spec(v, repr(name), first.path)
            tiles = []
            for rs in ranks:
                spec = _spec(rs.items[name], repr(name), rs.path)
                if spec[:3] != spec0[:3]:
                    raise CheckpointError(f"{name!r}: shape, dtype or placements differ from rank 0's", rs.path)
                if all(c == 0 for d, c in zip(spec.dims, spec.coords, strict=True) if d is None):
                    tile = _tile(name, spec, sizes, rs.items[name], rs.path)
                    tiles += [tile] if tile else []
            why = tiling_error(spec0.shape, tiles)
            if why:
                raise CheckpointError(f"{name!r}: {why}", first.path.parent)
            entries[name] = Entry(name, spec0.dtype, spec0.shape, tuple(tiles))
        elif hasattr(v, "dtype") and hasattr(v, "shape"):  # a plain tensor: every rank holds it whole
            for rs in ranks[1:]:
                other = rs.items[name]
                if getattr(other, "shape", None) != v.shape or getattr(other, "dtype", None) != v.dtype:
                    raise CheckpointError(f"{name!r}: a plain tensor of another shape or dtype than rank 0's", rs.path)
            entries[name] = Entry(name, v.dtype, v.shape, (Tile(v.path, v.start, (0,) * len(v.shape), v.shape),))
        else:
            skipped.append(name)
    return entries, skipped


def read_verl(actor: Path) -> tuple[dict[str, Entry], list[Path], list[str]]:
    """The model of a verl FSDP actor folder by tensor (HF names), its rank files, and notices."""
    world = world_size(actor)
    paths = rank_files(actor, world)
    ranks = [read_rank(p) for p in paths]
    lora = [n for n in ranks[0].items if "lora_" in n]
    if lora:
        raise CheckpointError(
            f"a verl LoRA actor ({len(lora)} lora_ tensors, e.g. {lora[0]!r}): not merged here; verl's merger "
            "writes the base weights and a lora_adapter/ beside them, which {merge_lora} takes",
            paths[0],
        )
    entries, skipped = consolidate(ranks, world)
    notices = [Info(f"{paths[0].name}: skipped entries that are not tensors: {listing(skipped)}")] if skipped else []
    return entries, paths, notices + left_beside(actor)


def left_beside(actor: Path) -> list[str]:
    """A notice naming what is not read beside the model: optimizer, extra state, data.pt, weights
    saved into huggingface/ (hf_model), other roles' folders."""
    out = [f"{glob} ({what})" for glob, what in LEFT_OUT if any(actor.glob(glob))]
    if any((actor / HF_DIR).glob("*.safetensors")):
        out.append(f"{HF_DIR}/ weights (hf_model)")
    step = actor.parent
    if actor.name == "actor" and (step / "data.pt").is_file():
        out.append("../data.pt (dataloader state)")
    if actor.name == "actor":
        out += [f"../{p.name}/ (another role)" for p in sorted(step.iterdir()) if p.is_dir() and p != actor]
    return [f"read the model rank files; left out: {listing(out, 6)}"] if out else []


def index_verl(path: Path, actor: Path, key: str | None, keep_tied: bool):
    """The Checkpoint of a verl actor folder: tensors as tiles over the rank files, the tied head
    as save_pretrained writes it (config from ``huggingface/``)."""
    from streamck.source.crosscheck import cross_check
    from streamck.source.index import Checkpoint, FileStamp, not_empty, tiled
    from streamck.source.tied import untie_fsdp

    if key is not None:
        raise CheckpointError(f"{{key}} {key}: a verl actor is read as its model state dict", path)
    files = {p: FileStamp.of(p) for p in actor.glob("model_world_size_*_rank_*.pt")}  # before reading
    entries, paths, notices = read_verl(actor)
    tensors, _ = tiled(entries, actor)
    side = actor / HF_DIR if (actor / HF_DIR).is_dir() else actor
    cross_check(side, tensors)
    found = Checkpoint(path, actor, tensors, {}, {p: files.get(p) or FileStamp.of(p) for p in paths}, notices, side)
    return untie_fsdp(not_empty(found, "verl actor"), keep_tied)
