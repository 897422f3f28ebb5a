"""Mixture-of-Experts layouts: a plan's experts written as ``save_pretrained`` writes them
(the default), kept fused as transformers runs them, or fused from per-expert files.

``apply_experts(plan, mode)`` runs after the rules (on output names): with ``mode="auto"`` the
fused runtime tensors a trainer saved (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``
[E, H, I]) become the family's per-expert tensors, the family read from config.json's
``model_type`` beside the checkpoint; ``"keep"`` writes them fused; ``"fuse"`` turns per-expert
tensors into the fused runtime ones. Every mode refuses, before anything is written, experts
missing, counts that disagree with the config and routers whose rows are not the expert count.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from streamck.errors import PlanError, UsageError
from streamck.plan.compile import OutputTensor, Plan
from streamck.plan.moe.blocks import Block, by_block, layout_line
from streamck.plan.moe.experts import blocks_of, check_count, check_per_expert, check_router, fuse_block, unfuse_block
from streamck.plan.moe.families import FAMILIES, REFUSED, Family, expert_count, family_of
from streamck.plan.moe.fp32 import keep_fp32 as _keep_fp32
from streamck.plan.moe.scales import tile_rows
from streamck.plan.rules import Rules

MODES = ("auto", "keep", "fuse")
NO_CONFIG = (
    "fused experts written as the trainer saved them (experts.gate_up_proj / experts.down_proj): no config.json "
    "beside the checkpoint names the model family; put the model's config.json there to have them written per "
    "expert as save_pretrained writes them (--keep-fused keeps them fused without this note)"
)


def read_config(plan: Plan) -> tuple[dict | None, Path | None]:
    """config.json beside the plan's source (where side files come from), parsed; (None, None)
    when there is none. PlanError for one that is not a JSON object."""
    ckpt = plan.source
    if ckpt is None:
        return None, None
    path = (ckpt.side_root or ckpt.root) / "config.json"
    if not path.is_file():
        return None, None
    try:
        config = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        raise PlanError(f"cannot read the model's config for its experts: {e}", path) from None
    if not isinstance(config, dict):
        raise PlanError("not a JSON object", path)
    return config, path


def apply_experts(plan: Plan, mode: str = "auto", *, builtin: str | None = None) -> Plan:
    """``plan`` with its MoE experts in the layout ``mode`` asks for (see the module's doc);
    the plan itself when it has no experts or comes from the built-in plan ``builtin`` (which
    writes its own layout). Raises UsageError for a mode not in MODES or one other than auto
    with a built-in plan; PlanError for a family with no known layout, or experts that
    disagree with the config."""
    if mode not in MODES:
        raise UsageError(f"experts={mode!r}: one of {', '.join(MODES)}")
    if builtin is not None:
        if mode != "auto":
            raise UsageError(f"{{keep_fused}} and {{fuse_experts}} do not apply to {{plan}} {builtin}")
        return plan
    blocks = blocks_of(plan)
    if not blocks and mode != "fuse":
        return plan
    config, path = read_config(plan)
    fused = any(b.fused for b in blocks.values())
    if config is None:
        if mode == "fuse" and blocks:
            raise PlanError("{fuse_experts} needs the model's config.json beside the checkpoint (its model_type)")
        if fused and mode == "auto":
            plan.notices.append(NO_CONFIG)
        return plan
    model_type = config.get("model_type")
    fam = family_of(model_type)
    if fam is not None and mode == "fuse":
        blocks = _to_runtime(plan, fam)
    if not blocks:
        return plan
    if fam is None:
        if mode == "keep":
            return plan
        hint = " ({keep_fused} writes them as they are)" if fused and mode == "auto" else ""
        if model_type in REFUSED:
            raise PlanError(f"model_type {model_type!r}: experts not rewritten, {REFUSED[model_type]}{hint}", path)
        known = ", ".join(sorted(FAMILIES))
        raise PlanError(f"model_type {model_type!r} has experts but no known layout{hint}; known: {known}", path)
    stated = expert_count(config)
    extra = sum(k if isinstance(k, int) else _int(config.get(k)) for k in fam.router_extra)
    ts = {t.name: t for t in plan.tensors}
    members = by_block(ts, blocks)  # once: a pass over every tensor per block was quadratic
    done: dict[str, list[OutputTensor]] = {}
    for b in blocks.values():
        if b.fused and b.experts:
            raise PlanError(f"MoE block {b.name}: both fused and per-expert tensors")
        if fam.block and b.leaf not in (fam.block, fam.disk_block):
            raise PlanError(f"MoE block {b.name}: {model_type} keeps its experts under .{fam.block}, not .{b.leaf}")
        block_ts = members.get(b.name, {})
        if b.fused:
            if mode == "auto":
                done[b.name] = unfuse_block(block_ts, b, fam, stated, extra, tile_rows(config))
            else:
                gu = next(iter(b.fused.values()))
                check_count(b.name, ts[gu].shape[0] if ts[gu].shape else 0, stated)
                check_router(ts, b.name, fam.router, ts[gu].shape[0] if ts[gu].shape else 0, extra)
        elif mode == "fuse" and fam.per_expert:
            done[b.name] = fuse_block(block_ts, b, fam, stated, extra, tile_rows(config))
        else:
            check_per_expert(ts, b, fam, stated, extra)
    return _replaced(plan, done, model_type, mode, fam)


def _int(value: object) -> int:
    """A config's count, 0 where it is missing or not a number."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _to_runtime(plan: Plan, fam: Family) -> dict[str, Block]:
    """For --fuse-experts: the plan's tensors that the family's files name otherwise than it runs
    (``names``; fused experts renamed on disk, Granite's ``input_linear``) under their runtime
    names, in place; the plan's MoE blocks after that."""
    disk = {f".{fam.disk_block}.{d}": f".{fam.block}.{r}" for r, d in fam.renames} if not fam.per_expert else {}
    for i, t in enumerate(plan.tensors):
        name = fam.runtime_name(t.name)
        for d, r in disk.items():
            if name.endswith(d):
                name = name[: -len(d)] + r
        if name != t.name:
            plan.tensors[i] = replace(t, name=name)
    return blocks_of(plan)


def _replaced(plan: Plan, done: dict[str, list[OutputTensor]], model_type: str, mode: str, fam: Family) -> Plan:
    """``plan`` with each rewritten block's tensors swapped for ``done``'s, every name under the
    family's disk names (runtime ones for ``fuse``), and a summary line."""
    if not done:
        return plan
    under = {n for block in by_block({t.name: t for t in plan.tensors}, done).values() for n in block}
    tensors = [t for t in plan.tensors if t.name not in under]
    tensors += [t for block in done.values() for t in block]
    if mode != "fuse":
        tensors = [replace(t, name=fam.disk_name(t.name)) for t in tensors]
    seen: dict[str, str] = {}
    for t in tensors:
        if t.name in seen:
            raise PlanError(f"MoE layout: {t.source.name} and {seen[t.name]} both become {t.name}")
        seen[t.name] = t.source.name
    tensors.sort(key=lambda t: t.name)
    plan.tensors = tensors
    if mode == "fuse":
        how = "fused, as transformers runs them"
    elif fam.per_expert:
        how = "per expert, as save_pretrained writes them"
    else:
        how = "fused, as save_pretrained writes them (this family keeps them fused on disk)"
    line = layout_line({t.name: t.shape for t in tensors}) or f"MoE: {model_type}"
    plan.summary.append(f"{line}: {model_type} experts written {how}")
    return plan


def keep_fp32(plan: Plan, rules: Rules) -> Plan:
    """``plan`` with what transformers keeps in float32 for the model_type of its config (the
    one a built-in plan writes, else the config.json beside the source) left uncast by
    ``--dtype`` (streamck.plan.moe.fp32); ``plan`` itself without a ``--dtype`` or a readable config."""
    if rules.dtype is None:
        return plan
    try:
        written = plan.files.get("config.json")
        config = json.loads(written) if written is not None else read_config(plan)[0]
    except (PlanError, ValueError):  # a config that is not one: nothing to keep, and not this step's to refuse
        return plan
    return _keep_fp32(plan, rules, config if isinstance(config, dict) else None)


__all__ = ["MODES", "apply_experts", "keep_fp32", "layout_line"]
