"""Which target layers an EAGLE-3 draft was trained on, and the ids each engine is told.

The ids are kept in Automodel's convention: id k is the output of target layer k. They come
from the caller, else the recipe snapshot beside the step (Automodel writes none into the
draft's config.json), else a config.json that holds some, else Automodel's default for the
target's depth. The keys and shifts are data in ``layout.py``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from streamck.errors import PlanError, UsageError, spelled
from streamck.plan.eagle3.layout import (
    CONFIG_AUX_KEYS,
    DEFAULT_AUX,
    RECIPE_AUX_KEY,
    RECIPE_SNAPSHOT,
)
from streamck.source.layout import CONSOLIDATED, HF_METADATA
from streamck.storage import location


@dataclass(frozen=True)
class AuxLayers:
    """Aux layer ids in Automodel's convention (the output of target layer k), where they came
    from (``source``) and the file that holds them, if one does (``where``)."""

    ids: tuple[int, ...]
    source: str
    where: Path | None = None

    def shifted(self, shift: int) -> list[int]:
        """The ids as a reader that adds ``shift`` to Automodel's needs them."""
        return [k + shift for k in self.ids]

    def write(self, config: dict, keys: tuple) -> None:
        """Set each of ``keys`` (path, shift, reader) in ``config`` to the ids its reader needs."""
        for path, shift, _ in keys:
            node = config
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = self.shifted(shift)

    def note(self, keys: tuple) -> str:
        """One line for the notice and the dry run: the ids, their source, what each reader gets."""
        served = "; ".join(f"{who}'s {'.'.join(path)} {self.shifted(shift)}" for path, shift, who in keys)
        held = f" in {self.where}" if self.where is not None else ""
        source = spelled(self.source, cli=True)  # a notice, printed as it is: the command line's words
        return f"aux layers {list(self.ids)} (outputs of target layers) from {source}{held}; written as {served}"


def default_aux_layer_ids(n: int) -> list[int]:
    """Automodel 0.7.0's default for a target of ``n`` layers (eagle/target.py
    default_eagle3_aux_layer_ids): a low, a middle and a high layer."""
    return [1, n // 2 - 1, n - 4]


def parse_aux_layer_ids(value: str | Sequence[int]) -> list[int]:
    """``"1,15,28"`` or a sequence of ints as a list; UsageError for anything else."""
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",")]
        if all(p.isdigit() for p in parts):
            return [int(p) for p in parts]
    elif isinstance(value, Sequence) and value and all(type(k) is int and k >= 0 for k in value):
        return list(value)
    raise UsageError(f"{{aux_layer_ids}} takes target layer numbers like 1,15,28, not {value!r}")


def recipe_snapshot(path: str | os.PathLike, directory: Path) -> Path | None:
    """The ``config.yaml`` of the step holding ``directory`` (the step itself, or the step
    above its ``model/consolidated`` or ``model/.hf_metadata``), if there is one."""
    steps = [location(path), directory]
    if directory.name in (CONSOLIDATED.name, HF_METADATA.name) and directory.parent.name == CONSOLIDATED.parent.name:
        steps.append(directory.parent.parent)
    for step in steps:
        if (step / RECIPE_SNAPSHOT).is_file():
            return step / RECIPE_SNAPSHOT
    return None


def _recipe_ids(snapshot: Path) -> object:
    import yaml  # only here: reading the recipe snapshot is the one use

    try:
        recipe = yaml.safe_load(snapshot.read_text(encoding="utf-8"))
    except OSError as e:
        raise PlanError(f"cannot read: {e.strerror}", snapshot) from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        reason = str(e).splitlines()[0]
        raise PlanError(f"not a readable recipe snapshot ({reason}); pass {{aux_layer_ids}}", snapshot) from None
    node = recipe
    for key in RECIPE_AUX_KEY:
        node = node.get(key) if isinstance(node, dict) else None
    return node


def _config_ids(config: dict, where: Path) -> tuple[object, str] | None:
    """Ids a training config.json holds, taken back to Automodel's convention; refused when
    its two keys disagree."""
    found = []
    for path, shift in CONFIG_AUX_KEYS:
        node: object = config
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if node is not None:
            ids = [k - shift for k in node] if shift and _ints(node) else node
            found.append((ids, ".".join(path) + (f" less {shift}" if shift else "")))
    if len(found) == 2 and found[0][0] != found[1][0]:
        raise PlanError(f"{found[0][1]} {found[0][0]} and {found[1][1]} {found[1][0]} disagree", where)
    return found[0] if found else None


def _ints(ids: object) -> bool:
    return isinstance(ids, list) and bool(ids) and all(type(k) is int for k in ids)


def resolve_aux_layers(
    config: dict, path: str | os.PathLike, directory: Path, given: Sequence[int] | str | None, n: int
) -> AuxLayers:
    """The ids the draft was trained on: ``given`` (the caller's), else the recipe snapshot's
    ``recipe_args.aux_layer_ids``, else the config's, else Automodel's default for ``n``
    target layers. Raises PlanError for ids that are not a list of layer numbers, or for a
    snapshot and config that disagree."""
    if given is not None:
        return AuxLayers(tuple(parse_aux_layer_ids(given)), "{aux_layer_ids}")
    snapshot = recipe_snapshot(path, directory)
    recipe = _recipe_ids(snapshot) if snapshot is not None else None
    where = directory / "config.json"
    in_config = _config_ids(config, where)
    if recipe is not None:
        label = ".".join(RECIPE_AUX_KEY)
        if not _ints(recipe):
            raise PlanError(f"{label} must be a list of layer numbers, not {recipe!r}", snapshot)
        if in_config is not None and in_config[0] != recipe:
            raise PlanError(f"{in_config[1]} {in_config[0]} disagree with {snapshot}'s {label} {recipe}", where)
        return AuxLayers(tuple(recipe), label, snapshot)
    if in_config is not None:
        ids, label = in_config
        if not _ints(ids):
            raise PlanError(f"{label} must be a list of layer numbers, not {ids!r}", where)
        return AuxLayers(tuple(ids), label, where)
    had = f"{snapshot} sets no {'.'.join(RECIPE_AUX_KEY)}" if snapshot is not None else f"no {RECIPE_SNAPSHOT}"
    return AuxLayers(tuple(default_aux_layer_ids(n)), f"Automodel's default {DEFAULT_AUX} for n = {n} ({had})")


def check_aux_layers(aux: AuxLayers, count: int, n: int, top: int, reason: str, where: Path) -> None:
    """Refuse ids the draft or the target cannot have: not ``count`` of them (the draft's fc
    takes ``count`` aux states), repeated, or outside 0 .. n - ``top`` (``reason`` says why
    the engine stops there). The error names the file holding the ids, else ``where``."""
    ids = list(aux.ids)
    where = aux.where or where
    if len(ids) != count:
        raise PlanError(f"{len(ids)} aux layer ids {ids} from {aux.source}: the draft's fc takes {count}", where)
    if len(set(ids)) != len(ids):
        raise PlanError(f"aux layer ids {ids} from {aux.source} repeat a layer", where)
    bad = [k for k in ids if k < 0 or k > n - top]
    if bad:
        raise PlanError(
            f"aux layer id {bad[0]} from {aux.source} is outside 0 .. {n - top} for a target of {n} layers{reason}",
            where,
        )
