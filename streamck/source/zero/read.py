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
from pathlib import Path
from typing import NamedTuple

from streamck.errors import CheckpointError, listing
from streamck.source.runs import Tile, tiling_error
from streamck.source.torchzip.inert import data_only
from streamck.source.torchzip.unpickle import Lazy
from streamck.source.zero.files import Cursor, RankFile, shape_of
from streamck.source.zero.ranks import ZeroSave, open_save
from streamck.storage import location


class Entry(NamedTuple):
    """One tensor of the checkpoint: 1-D ``tiles`` over its flattened elements, real ``shape``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    tiles: tuple[Tile, ...]


class _Model(NamedTuple):
    """What the model states file (rank 0's) says of the model."""

    rf: RankFile
    module: dict  # the module's state dict: buffers, and ZeRO-1's frozen params
    param_shapes: list[dict]  # per param group: name -> shape, in partition order
    buffer_names: list
    shared: dict  # tied alias -> the name it ties to


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
    save = open_save(step_dir)
    model = _model(save.models[0])
    notices: list[str] = []
    inert = sorted(set().union(*(data_only(m.obj) for m in save.models)))
    if inert:
        notices.append(f"client state objects {listing(inert, 3)} read as inert data, never run")
    # in zero_to_fp32's order: buffers, frozen params, params, aliases
    table = _Table()
    notices += _buffers(table, model)
    trainable = [(n, shape_of(s, repr(n), model.rf.path)) for g in model.param_shapes for n, s in g.items()]
    notices += _frozen(table, save, model, {n for n, _ in trainable})
    dtypes = {p.dtype for parts in save.groups for p in parts}
    dtype = dtypes.pop() if dtypes else "F32"
    if save.stage == 3:
        _params_zero3(table, save, trainable, dtype, model.rf.path)
    else:
        _params_zero12(table, save, model, dtype)
    aliases = _aliases(table, model.shared, notices)
    if not table.entries:
        raise CheckpointError("the ZeRO state holds no parameters and no buffers: nothing to write", step_dir)
    return table.entries, aliases, notices


def _model(rf: RankFile) -> _Model:
    sd = rf.obj
    module = sd.get("module")
    if not isinstance(module, dict):
        raise CheckpointError("no module state dict", rf.path)
    param_shapes = sd.get("param_shapes")
    if not isinstance(param_shapes, list) or not all(isinstance(g, dict) for g in param_shapes):
        raise CheckpointError("no param_shapes list (saved without ZeRO optimizer state?)", rf.path)
    buffer_names = sd.get("buffer_names") or []
    shared = sd.get("shared_params") or {}
    if not isinstance(buffer_names, list) or not isinstance(shared, dict):
        raise CheckpointError("bad buffer_names or shared_params", rf.path)
    return _Model(rf, module, param_shapes, buffer_names, shared)


class _Table:
    """The tensors placed so far, each checked as it is added: a string name, saved once, and
    tiles that cover its elements exactly."""

    def __init__(self) -> None:
        self.entries: dict[str, Entry] = {}

    def add(self, name: object, dtype: str, shape: tuple[int, ...], tiles: list[Tile], where: Path) -> None:
        if not isinstance(name, str):
            raise CheckpointError(f"tensor name {name!r:.60} is not a string", where)
        if name in self.entries:
            raise CheckpointError(f"{name!r} is saved twice (param, frozen param or buffer)", where)
        err = tiling_error((math.prod(shape),), tiles)
        if err:
            raise CheckpointError(f"{name!r}: {err}", where)
        self.entries[name] = Entry(name, dtype, shape, tuple(tiles))

    def whole(self, name: str, t: object, rf: RankFile, shape: tuple[int, ...] | None = None) -> None:
        """A tensor saved whole in ``rf`` (a buffer, a frozen param), with ``shape`` if given."""
        f = rf.flat(t, repr(name))
        shape = tuple(t.size) if shape is None else shape
        if math.prod(shape) != f.numel:
            raise CheckpointError(f"{name!r}: {f.numel} elements saved for shape {list(shape)}", rf.path)
        self.add(name, f.dtype, shape, [Tile(f.path, f.start, (0,), (f.numel,))] if f.numel else [], rf.path)


def _buffers(table: _Table, model: _Model) -> list[str]:
    """The buffers from the module copy, in their saved dtype."""
    low = []
    for name in model.buffer_names:
        if name in model.module and isinstance(model.module[name], Lazy):
            table.whole(name, model.module[name], model.rf)
            if table.entries[name].dtype in ("F16", "BF16", "F64"):
                low.append(name)
    if not low:
        return []
    return [
        f"buffers {listing(low, 4)} are kept as saved ({table.entries[low[0]].dtype}); "
        "zero_to_fp32 makes every floating buffer F32"
    ]


def _frozen(table: _Table, save: ZeroSave, model: _Model, trained: set[str]) -> list[str]:
    """The frozen params: ZeRO-3's fragments across ranks, ZeRO-2's saved whole, or ZeRO-1's
    from the module copy (which saves no ``frozen_param_*``)."""
    sd, path = model.rf.obj, model.rf.path
    shapes = sd.get("frozen_param_shapes")
    if save.stage == 3 and shapes:
        for name, s in shapes.items():
            _frozen_fragments(table, save, name, shape_of(s, repr(name), path), path)
        return []
    if shapes:
        frags = sd.get("frozen_param_fragments")
        if not isinstance(frags, dict):
            raise CheckpointError("frozen_param_shapes without frozen_param_fragments", path)
        for name, s in shapes.items():
            if name not in frags:
                raise CheckpointError(f"frozen param {name!r} has no saved tensor", path)
            table.whole(name, frags[name], model.rf, shape_of(s, repr(name), path))
        return []
    if save.stage == 3:
        return []
    return _frozen_in_module(table, save, model, trained)


def _frozen_fragments(table: _Table, save: ZeroSave, name: str, shape: tuple[int, ...], where: Path) -> None:
    """A ZeRO-3 frozen param: each rank's fragment, concatenated, holds its first n elements."""
    n, at, tiles, dtype = math.prod(shape), 0, [], None
    for r, m in enumerate(save.models):
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
        raise CheckpointError(f"frozen param {name!r}: fragments hold {at} of {n} elements", save.step_dir)
    table.add(name, dtype or "F32", shape, tiles, where)


def _frozen_in_module(table: _Table, save: ZeroSave, model: _Model, trained: set[str]) -> list[str]:
    """ZeRO-1 saves no frozen_param_*: what is left of the module is the frozen params (and
    params with no elements, which are in no partition)."""
    frozen = [
        n
        for n, t in model.module.items()
        if isinstance(t, Lazy) and n not in trained and n not in model.buffer_names and n not in model.shared
    ]
    for name in frozen:
        table.whole(name, model.module[name], model.rf)
    # a trainable param with no elements is in no partition either: not frozen
    empty = [n for n in frozen if not table.entries[n].tiles]
    frozen = [n for n in frozen if table.entries[n].tiles]
    notices = []
    if frozen:
        left_out = "; zero_to_fp32 leaves them out" if "zero_stage" in save.osd else ""
        notices.append(
            f"frozen params {listing(frozen, 4)} read from the module copy in {model.rf.path.name} "
            f"({table.entries[frozen[0]].dtype}{left_out})"
        )
    if empty:
        notices.append(f"params with no elements {listing(empty, 4)} written as saved in {model.rf.path.name}")
    return notices


def _params_zero3(
    table: _Table, save: ZeroSave, trainable: list[tuple[str, tuple[int, ...]]], dtype: str, where: Path
) -> None:
    """ZeRO-3: each param takes ``ceil(n/W)`` slots of every rank's flat vector, rank r holding
    elements ``[r·pn, min(n, (r+1)·pn))``; the slots fill each rank's vector exactly."""
    groups, ranks, world = save.groups, save.ranks, save.world
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
            tiles += cur.tiles(offset, max(0, min(pn, n - r * pn)), r * pn)
        table.add(name, dtype, shape, tiles, where)
        offset += pn
    if offset != cursors[0].numel:
        raise CheckpointError(
            f"param_shapes use {offset} elements per rank, fp32_flat_groups hold {cursors[0].numel}", ranks[0].path
        )


def _params_zero12(table: _Table, save: ZeroSave, model: _Model, dtype: str) -> None:
    """ZeRO-1/2: each param group's partitions, concatenated over ranks, hold its params one
    after another, each followed by its alignment padding."""
    if len(model.param_shapes) != len(save.groups[0]):
        raise CheckpointError(
            f"{len(model.param_shapes)} param groups in param_shapes, {len(save.groups[0])} in the optimizer state",
            model.rf.path,
        )
    paddings = save.osd.get("param_alignment_paddings")
    for g, shapes in enumerate(model.param_shapes):
        pads = None if paddings is None else paddings[g] if g < len(paddings) else None
        if paddings is not None and (not isinstance(pads, list) or len(pads) != len(shapes)):
            raise CheckpointError(
                f"param group {g}: {len(shapes)} params but param_alignment_paddings "
                f"{'missing' if pads is None else len(pads)}",
                save.ranks[0].path,
            )
        _param_group(table, save, model, g, shapes, pads, dtype)


def _param_group(
    table: _Table, save: ZeroSave, model: _Model, g: int, shapes: dict, pads: list | None, dtype: str
) -> None:
    cur = Cursor([parts[g] for parts in save.groups])
    offset = 0
    for i, (name, s) in enumerate(shapes.items()):
        shape = shape_of(s, repr(name), model.rf.path)
        n = math.prod(shape)
        if offset + n > cur.numel:
            raise CheckpointError(
                f"param group {g}: params need more than the {cur.numel} elements the ranks hold (at {name!r})",
                save.step_dir,
            )
        table.add(name, dtype, shape, cur.tiles(offset, n, 0), model.rf.path)
        offset += n
        if pads is not None:
            if type(pads[i]) is not int or pads[i] < 0:
                raise CheckpointError(f"param group {g}: bad alignment padding {pads[i]!r:.20}", save.ranks[0].path)
            offset += pads[i]
    # the last rank's partition omits the group's tail padding: lengths agree rounded up to 2·W
    align = 2 * save.world
    if -(-offset // align) != -(-cur.numel // align):
        raise CheckpointError(f"param group {g}: params use {offset} of the ranks' {cur.numel} elements", save.step_dir)


def _aliases(table: _Table, shared: dict, notices: list[str]) -> dict[str, str]:
    """``shared_params``' tied aliases, each written under its own name with its target's tiles."""
    dangling, aliases = [], {}
    for alias, target in shared.items():
        if target in table.entries:
            e = table.entries[target]
            table.entries.pop(alias, None)
            table.entries[alias] = Entry(alias, e.dtype, e.shape, e.tiles)
            aliases[alias] = target
        else:
            dangling.append(f"{alias} -> {target}")
    if dangling:
        notices.append(f"tied aliases without a saved target left out: {listing(dangling, 4)}")
    return aliases
