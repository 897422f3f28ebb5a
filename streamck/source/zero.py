"""DeepSpeed ZeRO checkpoints (stages 1–3) read as tiles over the ranks' fp32 master weights.

No torch, no deepspeed: every rank file's ``data.pkl`` is unpickled by a restricted
unpickler that turns DeepSpeed objects (``ZeroStageEnum``, ``LossScaler``,
``fragment_address``…) into inert stand-ins holding their pickled arguments, and tensors
into references to storage records. The layout is zero_to_fp32's (DeepSpeed 0.19):

- ZeRO-1/2: each of the W ``*zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` holds, per param
  group, ``single_partition_of_fp32_groups[g]``; the ranks' partitions, concatenated, are the
  group's flat fp32 vector (the last rank's tensor omits the group's tail padding, so it can
  be shorter than its storage record). The params of ``param_shapes[g]`` follow one another
  in it, each followed by ``param_alignment_paddings[g][i]`` elements; a param may straddle
  ranks. Consumed and available lengths agree once both are rounded up to 2·W.
- ZeRO-3: each rank's ``fp32_flat_groups`` (one per sub-group) concatenated is that rank's
  flat vector; params, in ``param_shapes`` order across sub-groups, take ``ceil(n/W)``
  slots each on every rank, rank r holding elements ``[r·pn, min(n, (r+1)·pn))``; a rank's
  slots add up exactly to its flat vector.
- Frozen params: ZeRO-3 ``frozen_param_shapes`` + each rank's ``frozen_param_fragments``
  (concatenated, first n elements); ZeRO-2 the full tensors in ``frozen_param_fragments``;
  ZeRO-1 saves none, so they are read from the module copy in ``mp_rank_00_model_states.pt``.
- Buffers (``buffer_names``) come from rank 0's ``module``, in their saved dtype;
  ``shared_params`` (rank 0) name tied aliases, written under every name.

Optimizer moments (``exp_avg``, ``exp_avg_sq``) are located in the pickle, never read.
Every tensor is described by 1-D tiles over its flattened elements (``offsets (k,)``,
``sizes (m,)``); the entry's ``shape`` is the real one.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import NamedTuple

from streamck.errors import CheckpointError, listing
from streamck.source.runs import Tile, tiling_error
from streamck.source.torchzip import _Lazy
from streamck.source.zero_files import Cursor, Flat, RankFile, data_only, save_stamp, shape_of, stage_of
from streamck.storage import UrlPath, location

OPTIM_RE = re.compile(r"^(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
Z3_MODEL_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
MODEL_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
MOE_RE = re.compile(r"(^|_)expert_\d+_.*model_states\.pt$|^expp_rank_\d+_.*optim_states\.pt$")
AUTOEP_KEYS = ("ds_autoep_layers", "autoep_layers")


class Entry(NamedTuple):
    """One tensor of the checkpoint: 1-D ``tiles`` over its flattened elements, real ``shape``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    tiles: tuple[Tile, ...]


def find_zero(path: Path) -> Path | None:
    """The step folder holding ZeRO state: ``path`` itself (``global_stepN/``), the one its
    ``latest`` file names (``checkpoint-N/``), or, with no ``latest``, its only folder
    holding ZeRO state; None when ``path`` is none of these.

    Raises CheckpointError when ``latest`` names something else, or when there is no
    ``latest`` and several folders hold ZeRO state (which one is the model is a guess).
    """
    path = location(path)
    if not path.is_dir():
        return None
    if _has_zero(path):
        return path
    latest = path / "latest"
    if latest.is_file():
        try:
            tag = latest.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"cannot read: {e}", latest) from None
        if not tag or "/" in tag or "\\" in tag or tag in (".", ".."):
            raise CheckpointError(f"names {tag!r}, not a step folder", latest)
        if not _has_zero(path / tag):
            raise CheckpointError(f"names {tag}, which holds no ZeRO optimizer state", latest)
        return path / tag
    # DeepSpeed's own tag is global_step<N>: only those folders are looked into (a DCP
    # folder beside them may hold thousands of files)
    if isinstance(path, UrlPath):
        named = [p for p in path.iterdir() if p.name.startswith("global_step") and p.is_dir()]
    else:
        with os.scandir(path) as it:
            named = [Path(e.path) for e in it if e.name.startswith("global_step") and e.is_dir()]
    found = sorted((p for p in named if _has_zero(p)), key=_step_order)
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise CheckpointError(
            f"no 'latest' file and {len(found)} folders of ZeRO state ({names}): "
            f"give the one to read, e.g. {path / found[-1].name}",
            path,
        )
    return found[0] if found else None


def _step_order(path: Path) -> tuple[int, str]:
    m = re.search(r"(\d+)$", path.name)
    return (int(m[1]) if m else -1, path.name)


def _has_zero(path: Path) -> bool:
    return path.is_dir() and any(OPTIM_RE.match(p.name) for p in path.iterdir())


def _stage(osd: dict) -> object:
    """The ZeRO stage of an optimizer state dict; DeepSpeed's BF16_Optimizer (bf16 with fp32
    gradient accumulation) records none, but partitions as ZeRO-1 does: fp32 partitions in
    ``single_partition_of_fp32_groups``, each group's flat vector padded to 2·W at its end."""
    if "zero_stage" in osd:
        return stage_of(osd["zero_stage"])
    if "single_partition_of_fp32_groups" in osd and "group_paddings" in osd:
        return 1
    return None


def _same_save(files: list[RankFile], step_dir: Path) -> None:
    """Refuse rank files that record different saves (a stale file copied from another step):
    each of save_stamp's values must agree across the files that record it, and the engine's
    ``global_steps`` must be the N of a ``global_stepN`` folder (DeepSpeed's own tag)."""
    m = re.fullmatch(r"global_step(\d+)", step_dir.name)
    seen: dict[str, tuple[object, str]] = {"global_steps": (int(m[1]), f"the folder name {m[0]}")} if m else {}
    for rf in files:
        for key, value in save_stamp(rf).items():
            first = seen.setdefault(key, (value, rf.path.name))
            if first[0] != value:
                raise CheckpointError(
                    f"rank files of different saves: {key} is {value!r} in {rf.path.name} but {first[0]!r} in "
                    f"{first[1]} (a file copied from another step?)",
                    step_dir,
                )


def rank_file_error(path: Path) -> CheckpointError | None:
    """The error for ``path`` when it is one rank's file of a ZeRO checkpoint, given alone."""
    if OPTIM_RE.match(path.name) or Z3_MODEL_RE.match(path.name) or MODEL_RE.match(path.name):
        return CheckpointError(f"one rank's file of a DeepSpeed ZeRO checkpoint: pass its folder, {path.parent}", path)
    return None


def read_zero(step_dir: Path) -> tuple[dict[str, Entry], dict[str, str], list[str]]:
    """Index the consolidated weights of the ZeRO checkpoint in ``step_dir`` (``global_stepN``):
    every param (fp32 master weights), frozen param, buffer and tied alias; the aliases
    (``shared_params``: alias → the name it ties to) and notices.

    Raises CheckpointError for MoE / expert-parallel files, tensor or pipeline parallel
    files, a missing or extra rank file, optimizer state offloaded to NVMe, counts that do
    not add up, and any pickle that names more than tensors and DeepSpeed bookkeeping.
    """
    step_dir = location(step_dir)
    if not step_dir.is_dir():
        raise CheckpointError("no such directory", step_dir)
    names = sorted(p.name for p in step_dir.iterdir() if p.is_file())
    notices: list[str] = []
    moe = [n for n in names if MOE_RE.search(n)]
    if moe:
        raise CheckpointError(
            f"MoE expert files ({listing(moe, 3)}): expert-parallel ZeRO state is not supported", step_dir
        )
    if any(n.startswith("layer_") and n.endswith("model_states.pt") for n in names):
        raise CheckpointError(
            "pipeline-parallel layer files: only data-parallel ZeRO checkpoints are supported", step_dir
        )
    optim: dict[int, Path] = {}
    for n in names:
        m = OPTIM_RE.match(n)
        if not m:
            continue
        if int(m[2]) != 0:
            raise CheckpointError(f"{n}: tensor-parallel rank files (mp_rank > 0) are not supported", step_dir)
        if int(m[1]) in optim:
            raise CheckpointError(f"two optimizer files for rank {m[1]}: {optim[int(m[1])].name} and {n}", step_dir)
        optim[int(m[1])] = step_dir / n
    if not optim:
        raise CheckpointError("no *_optim_states.pt files: not a ZeRO checkpoint", step_dir)
    if 0 not in optim:
        raise CheckpointError("rank 0's optimizer file (zero_pp_rank_0_…_optim_states.pt) is missing", step_dir)

    first = RankFile(optim[0])
    osd = first.obj.get("optimizer_state_dict")
    if not isinstance(osd, dict) or _stage(osd) is None:
        raise CheckpointError("no optimizer_state_dict with ZeRO partitions: not a ZeRO optimizer file", first.path)
    if osd.get("ds_zero_partition_groups"):
        raise CheckpointError(
            "ZeRO-3 expert partition groups (AutoEP MoE): expert-parallel state is not supported", first.path
        )
    stage = _stage(osd)
    if stage not in (1, 2, 3):
        raise CheckpointError(f"unknown ZeRO stage {stage!r:.40}", first.path)
    count = osd.get("partition_count")
    counts = count if isinstance(count, list) else [count]
    if not counts or not all(type(c) is int and c > 0 for c in counts):
        raise CheckpointError(f"bad partition_count {count!r:.60}", first.path)
    if len(set(counts)) > 1:
        raise CheckpointError(
            f"param groups partitioned over different world sizes {counts} (expert parallel?): not supported",
            first.path,
        )
    world = counts[0]
    missing = [r for r in range(world) if r not in optim]
    if missing:
        raise CheckpointError(
            f"rank file(s) for rank {listing([str(r) for r in missing])} missing: world size is {world}", step_dir
        )
    if len(optim) != world:
        raise CheckpointError(f"{len(optim)} optimizer rank files for a world size of {world}", step_dir)

    ranks = [first] + [RankFile(optim[r]) for r in range(1, world)]
    key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    groups: list[list[Flat]] = []  # [rank][group]
    for rf in ranks:
        o = rf.obj.get("optimizer_state_dict")
        if not isinstance(o, dict) or _stage(o) != stage or o.get("partition_count") != count:
            theirs = (_stage(o), o.get("partition_count")) if isinstance(o, dict) else None
            raise CheckpointError(
                f"ZeRO stage and partition count {theirs!r:.40} here, {(stage, count)!r:.40} in {optim[0].name}",
                rf.path,
            )
        flat = o.get(key)
        if not isinstance(flat, list):
            raise CheckpointError(f"no {key} list in the optimizer state", rf.path)
        groups.append([rf.flat(t, f"{key}[{g}]") for g, t in enumerate(flat)])
        if len(groups[-1]) != len(groups[0]):
            raise CheckpointError(f"{len(groups[-1])} {key}, rank 0 has {len(groups[0])}", rf.path)
    dtypes = {p.dtype for parts in groups for p in parts}
    if len(dtypes) > 1:
        raise CheckpointError(f"fp32 master partitions of mixed dtypes {sorted(dtypes)}", step_dir)

    if stage == 3:
        models = []
        for r in range(world):
            p = step_dir / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"
            if not p.is_file():
                raise CheckpointError(
                    f"rank {r}'s model states file {p.name} is missing (world size {world})", step_dir
                )
            models.append(RankFile(p))
        extra = [n for n in names if Z3_MODEL_RE.match(n) and int(Z3_MODEL_RE.match(n)[1]) >= world]
        if extra:
            raise CheckpointError(f"model states files beyond world size {world}: {listing(extra, 3)}", step_dir)
    else:
        p = step_dir / "mp_rank_00_model_states.pt"
        if not p.is_file():
            raise CheckpointError(f"{p.name} is missing", step_dir)
        models = [RankFile(p)]
    _same_save([*ranks, *models], step_dir)
    inert = sorted(set().union(*(data_only(m.obj) for m in models)))
    if inert:
        notices.append(f"client state objects {listing(inert, 3)} read as inert data, never run")
    for m in models:
        if any(k in m.obj for k in AUTOEP_KEYS if m.obj.get(k)):
            raise CheckpointError("AutoEP MoE layers: expert-parallel ZeRO state is not supported", m.path)
    model = models[0]
    sd = model.obj
    module = sd.get("module")
    if not isinstance(module, dict):
        raise CheckpointError("no module state dict", model.path)
    param_shapes = sd.get("param_shapes")
    if not isinstance(param_shapes, list) or not all(isinstance(g, dict) for g in param_shapes):
        raise CheckpointError("no param_shapes list (saved without ZeRO optimizer state?)", model.path)
    buffer_names = sd.get("buffer_names") or []
    shared = sd.get("shared_params") or {}
    if not isinstance(buffer_names, list) or not isinstance(shared, dict):
        raise CheckpointError("bad buffer_names or shared_params", model.path)

    entries: dict[str, Entry] = {}

    def add(name: object, dtype: str, shape: tuple[int, ...], tiles: list[Tile], where: Path) -> None:
        if not isinstance(name, str):
            raise CheckpointError(f"tensor name {name!r:.60} is not a string", where)
        if name in entries:
            raise CheckpointError(f"{name!r} is saved twice (param, frozen param or buffer)", where)
        err = tiling_error((math.prod(shape),), tiles)
        if err:
            raise CheckpointError(f"{name!r}: {err}", where)
        entries[name] = Entry(name, dtype, shape, tuple(tiles))

    def whole(name: str, t: object, rf: RankFile, shape: tuple[int, ...] | None = None) -> None:
        f = rf.flat(t, repr(name))
        shape = tuple(t.size) if shape is None else shape
        if math.prod(shape) != f.numel:
            raise CheckpointError(f"{name!r}: {f.numel} elements saved for shape {list(shape)}", rf.path)
        add(name, f.dtype, shape, [Tile(f.path, f.start, (0,), (f.numel,))] if f.numel else [], rf.path)

    # buffers, as zero_to_fp32 orders them: buffers, frozen params, params, aliases
    low = []
    for name in buffer_names:
        if name in module and isinstance(module[name], _Lazy):
            whole(name, module[name], model)
            if entries[name].dtype in ("F16", "BF16", "F64"):
                low.append(name)
    if low:
        notices.append(
            f"buffers {listing(low, 4)} are kept as saved ({entries[low[0]].dtype}); "
            "zero_to_fp32 makes every floating buffer F32"
        )

    trainable = [(n, shape_of(s, repr(n), model.path)) for g in param_shapes for n, s in g.items()]
    trained = {n for n, _ in trainable}
    frozen_shapes = sd.get("frozen_param_shapes")
    if stage == 3 and frozen_shapes:
        for name, s in frozen_shapes.items():
            shape = shape_of(s, repr(name), model.path)
            n, at, tiles, dtype = math.prod(shape), 0, [], None
            for r, m in enumerate(models):
                frags = m.obj.get("frozen_param_fragments")
                if not isinstance(frags, dict) or name not in frags:
                    raise CheckpointError(f"frozen param {name!r} has no fragment here", m.path)
                f = m.flat(frags[name], f"frozen param {name!r}")
                if dtype not in (None, f.dtype):
                    raise CheckpointError(f"frozen param {name!r}: rank {r} has {f.dtype}, rank 0 {dtype}", m.path)
                dtype, take = f.dtype, min(f.numel, n - at)
                if take:
                    tiles.append(Tile(f.path, f.start, (at,), (take,)))
                at += take
            if at != n:
                raise CheckpointError(f"frozen param {name!r}: fragments hold {at} of {n} elements", step_dir)
            add(name, dtype or "F32", shape, tiles, model.path)
    elif frozen_shapes:
        frags = sd.get("frozen_param_fragments")
        if not isinstance(frags, dict):
            raise CheckpointError("frozen_param_shapes without frozen_param_fragments", model.path)
        for name, s in frozen_shapes.items():
            if name not in frags:
                raise CheckpointError(f"frozen param {name!r} has no saved tensor", model.path)
            whole(name, frags[name], model, shape_of(s, repr(name), model.path))
    elif stage < 3:
        # ZeRO-1 saves no frozen_param_*: what is left of the module is the frozen params
        # (and params with no elements, which are in no partition)
        frozen = [
            n
            for n, t in module.items()
            if isinstance(t, _Lazy) and n not in trained and n not in buffer_names and n not in shared
        ]
        for name in frozen:
            whole(name, module[name], model)
        # a trainable param with no elements is in no partition either: not frozen
        empty = [n for n in frozen if not entries[n].tiles]
        frozen = [n for n in frozen if entries[n].tiles]
        if frozen:
            notices.append(
                f"frozen params {listing(frozen, 4)} read from the module copy in {model.path.name} "
                f"({entries[frozen[0]].dtype}{'; zero_to_fp32 leaves them out' if 'zero_stage' in osd else ''})"
            )
        if empty:
            notices.append(f"params with no elements {listing(empty, 4)} written as saved in {model.path.name}")

    dtype = dtypes.pop() if dtypes else "F32"
    if stage == 3:
        for r, parts in enumerate(groups):
            empty = [g for g, p in enumerate(parts) if p.numel == 0]
            if empty:
                raise CheckpointError(
                    f"fp32_flat_groups[{empty[0]}] is empty: the optimizer state was offloaded to NVMe "
                    "and is not in this checkpoint",
                    ranks[r].path,
                )
            if [p.numel for p in parts] != [p.numel for p in groups[0]]:
                raise CheckpointError("fp32_flat_groups sizes differ from rank 0's", ranks[r].path)
        cursors = [Cursor(parts) for parts in groups]
        offset = 0
        for name, shape in trainable:
            n = math.prod(shape)
            pn = -(-n // world)
            if offset + pn > cursors[0].numel:
                raise CheckpointError(
                    f"param_shapes need more than the {cursors[0].numel} elements of each rank's fp32_flat_groups",
                    ranks[0].path,
                )
            tiles = []
            for r, cur in enumerate(cursors):
                real = max(0, min(pn, n - r * pn))
                tiles += cur.tiles(offset, real, r * pn)
            add(name, dtype, shape, tiles, model.path)
            offset += pn
        if offset != cursors[0].numel:
            raise CheckpointError(
                f"param_shapes use {offset} elements per rank, fp32_flat_groups hold {cursors[0].numel}", ranks[0].path
            )
    else:
        if len(param_shapes) != len(groups[0]):
            raise CheckpointError(
                f"{len(param_shapes)} param groups in param_shapes, {len(groups[0])} in the optimizer state",
                model.path,
            )
        paddings = osd.get("param_alignment_paddings")
        align = 2 * world
        for g, shapes in enumerate(param_shapes):
            pads = None if paddings is None else paddings[g] if g < len(paddings) else None
            if paddings is not None and (not isinstance(pads, list) or len(pads) != len(shapes)):
                raise CheckpointError(
                    f"param group {g}: {len(shapes)} params but param_alignment_paddings "
                    f"{'missing' if pads is None else len(pads)}",
                    ranks[0].path,
                )
            cur = Cursor([parts[g] for parts in groups])
            offset = 0
            for i, (name, s) in enumerate(shapes.items()):
                shape = shape_of(s, repr(name), model.path)
                n = math.prod(shape)
                if offset + n > cur.numel:
                    raise CheckpointError(
                        f"param group {g}: params need more than the {cur.numel} elements the ranks hold (at {name!r})",
                        step_dir,
                    )
                add(name, dtype, shape, cur.tiles(offset, n, 0), model.path)
                offset += n
                if pads is not None:
                    if type(pads[i]) is not int or pads[i] < 0:
                        raise CheckpointError(f"param group {g}: bad alignment padding {pads[i]!r:.20}", ranks[0].path)
                    offset += pads[i]
            if -(-offset // align) != -(-cur.numel // align):
                raise CheckpointError(
                    f"param group {g}: params use {offset} of the ranks' {cur.numel} elements", step_dir
                )

    dangling, aliases = [], {}
    for alias, target in shared.items():
        if target in entries:
            e = entries[target]
            entries.pop(alias, None)
            entries[alias] = Entry(alias, e.dtype, e.shape, e.tiles)
            aliases[alias] = target
        else:
            dangling.append(f"{alias} -> {target}")
    if dangling:
        notices.append(f"tied aliases without a saved target left out: {listing(dangling, 4)}")
    if not entries:
        raise CheckpointError("the ZeRO state holds no parameters and no buffers: nothing to write", step_dir)
    return entries, aliases, notices
