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
from pathlib import Path

from streamck.errors import PlanError, UsageError
from streamck.plan.compile import OutputTensor, Plan
from streamck.plan.moe.blocks import layout_line
from streamck.plan.moe.experts import blocks_of, check_count, check_per_expert, check_router, fuse_block, unfuse_block
from streamck.plan.moe.families import FAMILIES, expert_count, family_of

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
            raise UsageError(f"--keep-fused and --fuse-experts do not apply to --plan {builtin}")
        return plan
    blocks = blocks_of(plan)
    if not blocks:
        return plan
    config, path = read_config(plan)
    fused = any(b.fused for b in blocks.values())
    if config is None:
        if mode == "fuse":
            raise PlanError("--fuse-experts needs the model's config.json beside the checkpoint (its model_type)")
        if fused and mode == "auto":
            plan.notices.append(NO_CONFIG)
        return plan
    model_type = config.get("model_type")
    fam = family_of(model_type)
    if fam is None:
        if mode == "keep":
            return plan
        known = ", ".join(sorted(FAMILIES))
        hint = " (--keep-fused writes them as they are)" if fused and mode == "auto" else ""
        raise PlanError(f"model_type {model_type!r} has experts but no known layout{hint}; known: {known}", path)
    stated = expert_count(config)
    ts = {t.name: t for t in plan.tensors}
    done: dict[str, list[OutputTensor]] = {}
    for b in blocks.values():
        if b.fused and b.experts:
            raise PlanError(f"MoE block {b.name}: both fused and per-expert tensors")
        if b.leaf not in (fam.block, fam.disk_block):
            raise PlanError(f"MoE block {b.name}: {model_type} keeps its experts under .{fam.block}, not .{b.leaf}")
        block_ts = {n: t for n, t in ts.items() if n.startswith(b.name + ".")}
        if b.fused:
            if mode == "auto":
                done[b.name] = unfuse_block(block_ts, b, fam, stated)
            else:
                gu = next(iter(b.fused.values()))
                check_count(b.name, ts[gu].shape[0] if ts[gu].shape else 0, stated)
                check_router(ts, b.name, fam.router, ts[gu].shape[0] if ts[gu].shape else 0)
        elif mode == "fuse" and fam.per_expert:
            done[b.name] = fuse_block(block_ts, b, fam, stated)
        else:
            check_per_expert(ts, b, fam, stated)
    return _replaced(plan, done, model_type, mode)


def _replaced(plan: Plan, done: dict[str, list[OutputTensor]], model_type: str, mode: str) -> Plan:
    """``plan`` with each rewritten block's tensors swapped for ``done``'s, and a summary line."""
    if not done:
        return plan
    prefixes = tuple(name + "." for name in done)
    tensors = [t for t in plan.tensors if not t.name.startswith(prefixes)]
    tensors += [t for block in done.values() for t in block]
    seen: dict[str, str] = {}
    for t in tensors:
        if t.name in seen:
            raise PlanError(f"MoE layout: {t.source.name} and {seen[t.name]} both become {t.name}")
        seen[t.name] = t.source.name
    tensors.sort(key=lambda t: t.name)
    plan.tensors = tensors
    how = "fused, as transformers runs them" if mode == "fuse" else "per expert, as save_pretrained writes them"
    line = layout_line({t.name: t.shape for t in tensors})
    plan.summary.append(f"{line}: {model_type} experts written {how}")
    return plan


__all__ = ["MODES", "apply_experts", "layout_line"]
