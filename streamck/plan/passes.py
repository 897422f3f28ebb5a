"""The passes a compiled plan goes through, in one ordered list.

streamck.api.build_plan compiles the source (its rules, or a built-in plan), then runs
PASSES in order, each reading what the one before wrote: fp32 keeps before the experts
are split (they name the fused tensors); LoRA merges into the experts as save_pretrained
names them; the quantization steps see the merged weights.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from streamck.errors import TORCH_HINT, PlanError, UsageError
from streamck.gcpause import paused
from streamck.plan.compile import Plan
from streamck.plan.options import PlanOptions
from streamck.plan.rules import Rules


def _fp32_keeps(plan: Plan, rules: Rules, o: PlanOptions, builtin: str | None) -> Plan:
    from streamck.plan.moe import keep_fp32

    with paused():
        return keep_fp32(plan, rules)


def _experts(plan: Plan, rules: Rules, o: PlanOptions, builtin: str | None) -> Plan:
    from streamck.plan.moe import apply_experts

    with paused():
        return apply_experts(plan, o.experts, builtin=builtin)


def _lora(plan: Plan, rules: Rules, o: PlanOptions, builtin: str | None) -> Plan:
    if o.merge_lora is None:
        return plan
    return _merge_lora(plan, o.merge_lora, o.safe_merge, o.merge_lora_any_base, o.merge_engine)


def _quantization(plan: Plan, rules: Rules, o: PlanOptions, builtin: str | None) -> Plan:
    return _quant_steps(plan, o)


Pass = Callable[[Plan, Rules, PlanOptions, "str | None"], Plan]
PASSES: tuple[tuple[str, Pass], ...] = (
    ("keep_fp32", _fp32_keeps),
    ("experts", _experts),
    ("merge_lora", _lora),
    ("quantize", _quantization),
)


def run_passes(plan: Plan, rules: Rules, options: PlanOptions, *, builtin: str | None = None) -> Plan:
    """``plan`` (compiled under ``rules``, by the built-in plan ``builtin`` if one) through
    every pass of PASSES, in order."""
    for _, step in PASSES:
        plan = step(plan, rules, options, builtin)
    return plan


def _quant_steps(plan: Plan, o: PlanOptions) -> Plan:
    """Dequantize a quantized source on ``--dtype``, or refuse a cast that would drop its scales;
    then quantize (``--quantize``). See streamck.plan.quant."""
    from streamck.plan.quant.dequant import SCALE_NAMES, dequantize_plan, quantized_kind
    from streamck.plan.quant.plan import quantize_plan

    if plan.source is not None and quantized_kind(plan) is not None:
        if o.quantize is not None:
            kind = quantized_kind(plan)
            raise PlanError(f"{{quantize}}: the source is already {kind}-quantized; dequantize it first")
        if o.dtype is not None:
            return dequantize_plan(plan, o.dtype)
        scales = [t.name for t in plan.tensors if t.is_cast and t.name.rpartition(".")[2] in SCALE_NAMES]
        if scales:
            raise PlanError(
                f"the source is {quantized_kind(plan)}-quantized: {{cast}} would change its scales ({scales[0]}, …), "
                "not its weights; dequantize with {dtype}"
            )
        return plan
    if o.quantize is None:
        return plan
    return quantize_plan(plan, o.quantize, list(o.quantize_ignore), o.quantize_lm_head, o.quantize_pad_partial)


def _merge_lora(plan: Plan, adapter: str | os.PathLike, safe_merge: bool, any_base: bool, engine: str | None) -> Plan:
    """``plan`` with the adapter merged in: by torch (PEFT's bits) when it is installed, else
    by numpy (not bit for bit), which the plan's summary and notices say."""
    from streamck.plan.lora.plan import ENGINES, merge_lora

    if engine is not None and engine not in ENGINES:
        raise UsageError(f"{{merge_engine}} {engine}: one of {', '.join(ENGINES)}")
    note = None
    if engine in (None, "torch"):
        try:
            import torch  # noqa: F401
        except ModuleNotFoundError:
            if engine == "torch":
                raise UsageError("{merge_engine} torch: torch is not installed: " + TORCH_HINT) from None
            note = "torch is not installed: merging with numpy, not bit for bit (see --merge-engine)"
    engine = engine or ("numpy" if note else "torch")
    merged = merge_lora(plan, adapter, safe_merge=safe_merge, any_base=any_base, engine=engine)
    if note:
        merged.notices.append(note)
    return merged
