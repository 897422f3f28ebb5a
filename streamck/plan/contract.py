"""The checks every built-in plan (``--plan eagle4``, ``eagle3``, ``torchtitan``,
``megatron-gpt``) runs on its input before a byte is written: only cast rules beside a
plan that fixes every name, a config that is a JSON object, tensors that are exactly the
plan's table, each of the shape the table gives; and where a draft's config lies. One neutral module, so that no plan
depends on another for them.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from streamck.errors import PlanError, listing
from streamck.plan.rules import Rules
from streamck.source.layout import CONSOLIDATED, HF_METADATA, hub_snapshot
from streamck.storage import location


@dataclass(frozen=True)
class Row:
    """One tensor of a built-in plan's layout table (each family's ``layout.py``), read by name.

    ``out`` is its name in the output (Hugging Face's, or the serving layout's), ``src`` its name
    in the trainer's checkpoint, ``shape`` its sides as products of the family's symbols
    (``("nh*d", "H")``). ``dtypes`` are the dtypes it may have where the table says them per row
    (EAGLE-3's; empty: the plan checks dtypes itself, as floats). ``permute`` is the row order it is
    written in (torchtitan's ``"q"``/``"k"``: RoPE pairs to halves; None: as stored), and
    ``legacy`` its name under the trainer's earlier version (torchtitan 0.2), where that differs.
    A name may hold ``{i}`` (a layer) or ``{e}`` (an expert), filled in by ``at``.
    """

    out: str
    src: str
    shape: tuple[str, ...]
    dtypes: tuple[str, ...] = ()
    permute: str | None = None
    legacy: str | None = None

    def at(self, **index: int) -> Row:
        """The row with ``index`` (``i=3``) filled into its names."""
        legacy = None if self.legacy is None else self.legacy.format(**index)
        return replace(self, out=self.out.format(**index), src=self.src.format(**index), legacy=legacy)

    def source(self, legacy: bool = False) -> str:
        """Its name in the checkpoint: ``src``, or under the earlier version (``legacy``) that one's."""
        return (self.legacy or self.src) if legacy else self.src


def only_casts(rules: Rules | None, plan: str) -> Rules:
    """``rules`` (none: empty) when they only cast; a plan that fixes every name refuses
    renames and drops."""
    rules = rules or Rules()
    others = sorted({r.kind for r in rules.rules if r.kind != "cast"})
    if others:
        raise PlanError(f"{{plan}} {plan} fixes every name; it cannot be combined with {', '.join(others)} rules")
    return rules


def find_checkpoint_dir(path: str | os.PathLike) -> Path:
    """The given directory if it holds config.json, else its ``model/consolidated``, else the
    config written beside a step's shards (``model/.hf_metadata``); for a Hugging Face cache
    entry or repo id, its snapshot."""
    path = hub_snapshot(location(path))
    for candidate in (path, path / CONSOLIDATED, path / HF_METADATA):
        if (candidate / "config.json").is_file():
            return candidate
    raise PlanError(f"no config.json in {path} nor in {path / CONSOLIDATED} or {path / HF_METADATA}")


def load_config(path: Path) -> dict:
    """The JSON object in ``path``, or a PlanError naming it."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise PlanError(f"cannot read: {e.strerror}", path) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanError(f"not valid JSON: {e}", path) from None
    if not isinstance(config, dict):
        raise PlanError("is not a JSON object", path)
    return config


def positive_int(value: object) -> bool:
    """Whether ``value`` is an int above zero (a bool is not)."""
    return type(value) is int and value > 0


def check_sizes(config: dict, required: Iterable[str], optional: Iterable[str], where: Path) -> None:
    """Refuse a config whose ``required`` size keys are missing or not positive integers, or
    whose ``optional`` ones are set to anything else."""
    for key in required:
        if key not in config:
            raise PlanError(f"required key {key!r} is missing", where)
        if not positive_int(config[key]):
            raise PlanError(f"{key} must be a positive integer, not {config[key]!r}", where)
    for key in optional:
        if config.get(key) is not None and not positive_int(config[key]):
            raise PlanError(f"{key} must be a positive integer, not {config[key]!r}", where)


def compare_keys(expected: Iterable[str], found: Iterable[str], mismatch: str, where: Path) -> None:
    """Refuse tensors whose names are not exactly ``expected``: ``mismatch`` (what they do
    not match), then the missing and the unexpected names."""
    expected, found = set(expected), set(found)
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if missing or unexpected:
        parts = [f"{len(v)} {k}: {listing(v)}" for k, v in (("missing", missing), ("unexpected", unexpected)) if v]
        raise PlanError(f"{mismatch}: " + "; ".join(parts), where)


def evaluate(expr: str, symbols: dict[str, int]) -> int:
    """A table expression (``H``, ``2*H``, ``nh*d``) with the config's symbols."""
    return math.prod(int(f) if f.isdigit() else symbols[f] for f in expr.split("*"))


def check_shape(
    name: str, shape: tuple[int, ...], exprs: tuple[str, ...], symbols: dict[str, int], names: dict, where: Path
) -> None:
    """Raise PlanError when ``shape`` is not the table's ``exprs`` evaluated with the config's
    ``symbols``: expected vs found, and the config keys behind (``names``: symbol -> key)."""
    want = tuple(evaluate(e, symbols) for e in exprs)
    if shape != want:
        used = dict.fromkeys(f for e in exprs for f in e.split("*") if not f.isdigit())
        behind = ", ".join(f"{u} = {names[u]}" for u in used)
        raise PlanError(
            f"{name} has shape {list(shape)}, expected {list(want)} = [{', '.join(exprs)}] from {behind}", where
        )
