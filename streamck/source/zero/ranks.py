"""The rank files of one DeepSpeed save, found, opened and checked against each other before a
tensor is placed: one optimizer file per data-parallel rank, all of one stage and partition
count, all of one save (no file copied from another step), and the model states beside them.

Refused here, each in one line: MoE / expert-parallel files, tensor- or pipeline-parallel
files, a missing or extra rank file, and partitions of mixed dtypes."""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import NamedTuple

from streamck.errors import CheckpointError, listing
from streamck.source.zero.files import Flat, RankFile, save_stamp, stage_of
from streamck.source.zero.find import MOE_RE, OPTIM_RE, Z3_MODEL_RE

AUTOEP_KEYS = ("ds_autoep_layers", "autoep_layers")


class ZeroSave(NamedTuple):
    """One save's rank files, opened: the optimizer files by rank (``ranks``) with their fp32
    partitions (``groups[rank][group]``), the model states (``models``: one per rank under
    ZeRO-3, else one), and what rank 0's optimizer state says of the partitioning."""

    step_dir: Path
    stage: int
    world: int
    osd: dict  # rank 0's optimizer_state_dict
    ranks: list[RankFile]
    groups: list[list[Flat]]
    models: list[RankFile]


def open_save(step_dir: Path) -> ZeroSave:
    """The rank files of the ZeRO save in ``step_dir``, checked to be one whole save."""
    names = sorted(p.name for p in step_dir.iterdir() if p.is_file())
    optim = _optim_files(step_dir, names)
    first = RankFile(optim[0])
    osd, stage, count = _partitioning(first)
    world = count[0] if isinstance(count, list) else count
    # A count claimed by the file (2**40 ranks) is never spelled out: the first few missing, and how many.
    missing = [str(r) for r in itertools.islice((r for r in range(world) if r not in optim), 8)]
    if missing:
        absent = world - sum(r < world for r in optim)
        shown = ", ".join(missing) + (f", … ({absent} in all)" if absent > len(missing) else "")
        raise CheckpointError(f"rank file(s) for rank {shown} missing: world size is {world}", step_dir)
    if len(optim) != world:
        raise CheckpointError(f"{len(optim)} optimizer rank files for a world size of {world}", step_dir)
    ranks = [first] + [RankFile(optim[r]) for r in range(1, world)]
    groups = _partitions(ranks, stage, count, optim[0].name)
    models = _model_files(step_dir, names, stage, world)
    _same_save([*ranks, *models], step_dir)
    for m in models:
        if any(k in m.obj for k in AUTOEP_KEYS if m.obj.get(k)):
            raise CheckpointError("AutoEP MoE layers: expert-parallel ZeRO state is not supported", m.path)
    return ZeroSave(step_dir, stage, world, osd, ranks, groups, models)


def stage(osd: dict) -> object:
    """The ZeRO stage of an optimizer state dict; DeepSpeed's BF16_Optimizer (bf16 with fp32
    gradient accumulation) records none, but partitions as ZeRO-1 does: fp32 partitions in
    ``single_partition_of_fp32_groups``, each group's flat vector padded to 2·W at its end."""
    if "zero_stage" in osd:
        return stage_of(osd["zero_stage"])
    if "single_partition_of_fp32_groups" in osd and "group_paddings" in osd:
        return 1
    return None


def _optim_files(step_dir: Path, names: list[str]) -> dict[int, Path]:
    """The optimizer file of each data-parallel rank, refusing the layouts not read."""
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
    return optim


def _partitioning(first: RankFile) -> tuple[dict, int, object]:
    """Rank 0's optimizer state dict, its ZeRO stage and its ``partition_count`` (an int, or
    one per param group, all equal: the world size)."""
    osd = first.obj.get("optimizer_state_dict")
    if not isinstance(osd, dict) or stage(osd) is None:
        raise CheckpointError("no optimizer_state_dict with ZeRO partitions: not a ZeRO optimizer file", first.path)
    if osd.get("ds_zero_partition_groups"):
        raise CheckpointError(
            "ZeRO-3 expert partition groups (AutoEP MoE): expert-parallel state is not supported", first.path
        )
    found = stage(osd)
    if found not in (1, 2, 3):
        raise CheckpointError(f"unknown ZeRO stage {found!r:.40}", first.path)
    count = osd.get("partition_count")
    counts = count if isinstance(count, list) else [count]
    if not counts or not all(type(c) is int and c > 0 for c in counts):
        raise CheckpointError(f"bad partition_count {count!r:.60}", first.path)
    if len(set(counts)) > 1:
        raise CheckpointError(
            f"param groups partitioned over different world sizes {counts} (expert parallel?): not supported",
            first.path,
        )
    return osd, found, count


def _partitions(ranks: list[RankFile], zero_stage: int, count: object, first: str) -> list[list[Flat]]:
    """Each rank's fp32 master partitions, one per param group (ZeRO-1/2) or sub-group (ZeRO-3)."""
    key = "fp32_flat_groups" if zero_stage == 3 else "single_partition_of_fp32_groups"
    groups: list[list[Flat]] = []
    for rf in ranks:
        o = rf.obj.get("optimizer_state_dict")
        if not isinstance(o, dict) or stage(o) != zero_stage or o.get("partition_count") != count:
            theirs = (stage(o), o.get("partition_count")) if isinstance(o, dict) else None
            raise CheckpointError(
                f"ZeRO stage and partition count {theirs!r:.40} here, {(zero_stage, count)!r:.40} in {first}",
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
        raise CheckpointError(f"fp32 master partitions of mixed dtypes {sorted(dtypes)}", ranks[0].path.parent)
    return groups


def _model_files(step_dir: Path, names: list[str], zero_stage: int, world: int) -> list[RankFile]:
    """The model states: every rank's under ZeRO-3 (each holds its frozen fragments), else rank 0's."""
    if zero_stage != 3:
        p = step_dir / "mp_rank_00_model_states.pt"
        if not p.is_file():
            raise CheckpointError(f"{p.name} is missing", step_dir)
        return [RankFile(p)]
    models = []
    for r in range(world):
        p = step_dir / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"
        if not p.is_file():
            raise CheckpointError(f"rank {r}'s model states file {p.name} is missing (world size {world})", step_dir)
        models.append(RankFile(p))
    extra = [n for n in names if Z3_MODEL_RE.match(n) and int(Z3_MODEL_RE.match(n)[1]) >= world]
    if extra:
        raise CheckpointError(f"model states files beyond world size {world}: {listing(extra, 3)}", step_dir)
    return models


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
