"""Tensors transformers keeps in float32 whatever dtype a model is loaded in, kept so by ``--dtype``.

A model class's ``_keep_in_fp32_modules_strict`` (DeepSeek-V3's routing bias
``e_score_correction_bias``, Ernie's router) stay float32 under ``from_pretrained(dtype=bf16)``
or fp16, its ``_keep_in_fp32_modules`` under fp16 only; ``save_pretrained`` then writes them in
float32. A pattern matches a tensor as transformers' loader matches it: a regular expression (``*``
read as ``.*``) searched anywhere in the runtime name. The patterns are the family's row
(streamck.plan.moe.families, ``fp32`` and ``fp32_fp16``); a tensor the plain ``--dtype`` would cast
is left in the dtype it is stored in, an explicit ``--cast`` still wins.
"""

from __future__ import annotations

import re
from dataclasses import replace

from streamck.plan.compile import Plan
from streamck.plan.moe.families import family_of
from streamck.plan.moe.layout import Family
from streamck.plan.rules import Rules

_SHOWN = 3  # names a notice lists before "…"


def _pattern(globs: tuple[str, ...]) -> re.Pattern[str] | None:
    """transformers' alternation of ``globs`` (build_glob_alternation), or None when there are none."""
    return re.compile("|".join(g.replace("*", ".*") for g in globs)) if globs else None


def _runtime(fam: Family, name: str) -> str:
    """``name`` as transformers runs it, where the family's files name it otherwise (a source
    already written as save_pretrained writes it: hy_v3's ``mlp.expert_bias``)."""
    name = fam.runtime_name(name)
    for run, disk in fam.renames:
        if name.endswith(f".{fam.disk_block}.{disk}"):
            return name[: -len(disk)] + run
    return name


def keep_fp32(plan: Plan, rules: Rules, config: dict | None) -> Plan:
    """``plan`` with the tensors that ``--dtype`` (``rules.dtype``) would cast to bf16 or fp16
    but transformers keeps in float32 for ``config``'s model_type left in their stored dtype,
    and a notice naming them; ``plan`` itself when there are none."""
    fam = family_of(config.get("model_type")) if config else None
    if fam is None or rules.dtype not in ("BF16", "F16"):
        return plan
    pattern = _pattern(fam.fp32 + (fam.fp32_fp16 if rules.dtype == "F16" else ()))
    if pattern is None:
        return plan
    kept = []
    for i, t in enumerate(plan.tensors):
        by_dtype = t.is_cast and t.dtype == rules.dtype and rules.cast_for(t.source.name) is None
        if by_dtype and pattern.search(_runtime(fam, t.name)):
            plan.tensors[i] = replace(t, dtype=t.source.dtype)
            kept.append(t.name)
    if kept:
        shown = ", ".join(kept[:_SHOWN]) + (", …" if len(kept) > _SHOWN else "")
        which = "_keep_in_fp32_modules_strict" if rules.dtype == "BF16" else "_keep_in_fp32_modules(_strict)"
        plan.notices.append(
            f"--dtype: {len(kept)} tensors kept in their stored dtype, as transformers keeps "
            f"{config['model_type']}'s {which} in float32 ({shown})"  # type: ignore[index]
        )
    return plan
