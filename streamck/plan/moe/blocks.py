"""Find the MoE blocks of a list of output tensors by their names: fused runtime experts
(``<block>.experts.gate_up_proj`` / ``down_proj``) and per-expert ones (``<block>.experts.E.P.weight``)."""

from __future__ import annotations

import re
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from streamck.plan.moe.families import FAMILIES
from streamck.plan.moe.layout import DOWN, GATE_UP

T = TypeVar("T")

_EXPERTS = ".experts"
_WEIGHT = ".weight"


@dataclass
class Block:
    """One MoE block by its name (``model.layers.3.mlp``): its fused tensors' names by kind,
    or its per-expert names by projection and expert index."""

    name: str
    fused: dict[str, str] = field(default_factory=dict)
    experts: dict[str, dict[int, str]] = field(default_factory=lambda: defaultdict(dict))

    @property
    def leaf(self) -> str:
        """The block's own module name (``mlp``)."""
        return self.name.rpartition(".")[2]


def find_blocks(names: Iterable[str]) -> dict[str, Block]:
    """Every block holding experts, fused or per-expert, by block name, in name order: fused
    ``<block>.experts.<gate_up|down>``, per-expert ``<block>.experts.<E>.<proj>.weight``.
    Names are cut from the right by ``rsplit`` (two regex matches a name were 0.15 s of a
    92k-tensor copy, #44)."""
    blocks: dict[str, Block] = {}
    for name in sorted(names):
        if _EXPERTS not in name:
            continue
        stem, _, kind = name.rpartition(".")
        if kind in (GATE_UP, DOWN):
            block = _block_of(stem)
            if block:
                _block(blocks, block).fused[kind] = name
            continue
        if kind != _WEIGHT[1:]:
            continue
        parts = stem.rsplit(".", 2)
        if len(parts) == 3 and parts[1].isdecimal() and parts[2]:
            block = _block_of(parts[0])
            if block:
                _block(blocks, block).experts[parts[2]][int(parts[1])] = name
    return blocks


def _block_of(stem: str) -> str | None:
    """The block of ``<block>.experts`` (a non-empty last component), else None."""
    if not stem.endswith(_EXPERTS):
        return None
    block = stem[: -len(_EXPERTS)]
    return block if block and not block.endswith(".") else None


def _block(blocks: dict[str, Block], name: str) -> Block:
    """Block ``name`` of ``blocks``, made once: ``setdefault(name, Block(name))`` made one per
    expert tensor (92k at DeepSeek-V3's size) to throw all but one away."""
    block = blocks.get(name)
    if block is None:
        block = blocks[name] = Block(name)
    return block


def by_block(items: Mapping[str, T], blocks: Iterable[str]) -> dict[str, dict[str, T]]:
    """``items`` (by name) grouped under each block that their names lie under (``a.b.c`` lies
    under ``a`` and ``a.b``), in name order; a block with nothing under it is absent.

    The names are sorted once and each block's are the range between ``block.`` and ``block/``
    (``/`` follows ``.``), found by bisection: testing every name against every block was
    quadratic, a block per layer (39% of a DeepSeek-V3 --dry-run, #44)."""
    names = sorted(items)
    out: dict[str, dict[str, T]] = {}
    for block in blocks:
        lo, hi = bisect_left(names, block + "."), bisect_left(names, block + "/")
        if lo < hi:
            out[block] = {n: items[n] for n in names[lo:hi]}
    return out


# Trainers' own grouped experts: name pattern -> (what holds them, the expert axis, layers stacked on axis 0).
GROUPED = {
    re.compile(r"(^|\.)moe\.routed_experts\.inner_experts\.w1_EFD$"): ("torchtitan", 0, False),
    # megatron-core stacks alike layers under one key, and keys each layer itself when dense and MoE
    # layers mix (``moe_layer_freq``, ``decoder.layers.N.…``: [E, 2F, H]).
    re.compile(r"(^|\.)layers\.mlp\.experts\.experts\.linear_fc1\.weight$"): ("Megatron", 1, True),
    re.compile(r"(^|\.)layers\.\d+\.mlp\.experts\.experts\.linear_fc1\.weight$"): ("Megatron", 0, False),
}


def _grouped_line(shapes: dict[str, tuple[int, ...]]) -> str | None:
    """The ``MoE:`` line for a trainer's grouped experts (torchtitan, Megatron), or None."""
    for pattern, (who, axis, stacked) in GROUPED.items():
        found = [shape for name, shape in shapes.items() if pattern.search(name) and len(shape) > axis]
        if found:
            counts = "/".join(str(c) for c in sorted({s[axis] for s in found}))
            blocks = sum(s[0] for s in found) if stacked else len(found)
            return f"MoE: {counts} experts, fused ({who}'s grouped layout, {blocks} blocks)"
    return None


# Fused experts under the names the families that rename them write (Granite-MoE's
# ``block_sparse_moe.input_linear.weight``, Aria's ``mlp.experts.fc1.weight``): their gate/up tensor's name ends.
_DISK_ENDS = {
    f".{fam.disk_block}.{disk}"
    for fam in FAMILIES.values()
    if not fam.per_expert
    for run, disk in fam.renames
    if run == f"experts.{GATE_UP}"
}
_DISK_FUSED = re.compile("(?:" + "|".join(re.escape(end) for end in sorted(_DISK_ENDS)) + ")$")


def _disk_fused_line(shapes: dict[str, tuple[int, ...]]) -> str | None:
    """The ``MoE:`` line for fused experts under a family's disk names, or None."""
    found = [shape for name, shape in shapes.items() if _DISK_FUSED.search(name) and shape]
    if not found:
        return None
    counts = "/".join(str(c) for c in sorted({s[0] for s in found}))
    return f"MoE: {counts} experts, fused ({len(found)} blocks)"


def layout_line(shapes: dict[str, tuple[int, ...]]) -> str | None:
    """``MoE: 8 experts, fused`` (or ``per-expert``; counts that differ between blocks are all
    listed) for tensors by name and shape; None when there are no experts."""
    blocks = find_blocks(shapes)
    if not blocks:
        return _grouped_line(shapes) or _disk_fused_line(shapes)
    counts: set[int] = set()
    kinds: set[str] = set()
    for b in blocks.values():
        if b.fused:  # counted by down where there is one: LongCat's gate/up has rows for its zero experts too
            kinds.add("fused")
            counts.update(shapes[n][0] for n in [b.fused.get(DOWN, b.fused.get(GATE_UP))] if n and shapes[n])
        if b.experts:
            kinds.add("per-expert")
            counts.add(min(len(ids) for ids in b.experts.values()))
    number = "/".join(str(c) for c in sorted(counts)) or "0"
    return f"MoE: {number} experts, {' and '.join(sorted(kinds))} ({len(blocks)} blocks)"
