"""``--plan torchtitan`` (alias ``torchtitan-llama3``): a torchtitan Llama 3, Qwen3, Qwen3-MoE or DeepSeek-V3 step.

A torchtitan step (``checkpoint/step-N/``: native DCP, model keys at the top level beside
``optimizer``, ``lr_scheduler``, ``dataloader`` and ``train_state``) becomes what
torchtitan's ``convert_to_hf.py`` writes, in one streaming pass: renamed per
``layout.py``, the query and key rows of Llama 3 reordered from torchtitan's
interleaved RoPE pairs to Hugging Face's rotate-half halves (Qwen3 needs none), the
output head left out when the config ties it. The sizes come from the model's
Hugging Face config (``--hf-config``, or ``config.json`` beside the step), which is
written beside the weights with its dtype set to theirs.
"""

from __future__ import annotations

import os
from pathlib import Path

from streamck.errors import PlanError
from streamck.plan import hf_export
from streamck.plan.compile import Plan
from streamck.plan.contract import Row, compare_keys, load_config, only_casts
from streamck.plan.rules import Rules
from streamck.plan.torchtitan.heads import _left_out, _same_head
from streamck.plan.torchtitan.layout import (
    FAMILIES,
    HEAD,
    LAYER,
    MOE_BIAS,
    MOE_FAMILIES,
    QK_NORM,
    TOP,
    TRAINING_STATE,
    VERSIONS,
)
from streamck.plan.torchtitan.moe import moe_keys, moe_outputs, moe_sizes
from streamck.source import TensorRef, open_checkpoint
from streamck.source.layout import DCP_METADATA
from streamck.source.select import Rows, select
from streamck.storage import location

PLAN = "torchtitan"
# Config flags for biases that torchtitan's Llama 3 and Qwen3 never have.
BIAS_FLAGS = ("attention_bias", "mlp_bias")


def _step_dir(path: Path) -> Path:
    """``path`` itself when it is a DCP step; a ``checkpoint/`` folder of ``step-N`` is
    refused with the steps it holds (which one to convert is the user's choice)."""
    if (path / DCP_METADATA).is_file():
        return path
    steps = sorted((p for p in path.glob("step-*") if (p / DCP_METADATA).is_file()), key=_step_number)
    if steps:
        names = ", ".join(p.name for p in steps)
        raise PlanError(f"holds torchtitan steps ({names}): give one of them, e.g. {path / steps[-1].name}", path)
    raise PlanError(f"is not a torchtitan step (no {DCP_METADATA}: torchtitan saves checkpoint/step-N/)", path)


def _step_number(step: Path) -> tuple[int, str]:
    """Sort key of a ``step-N`` folder: by N as a number (step-9 before step-10), then by name."""
    tail = step.name.removeprefix("step-")
    return (int(tail), "") if tail.isdigit() else (-1, step.name)


def _version(names: set[str], where: Path) -> str:
    """Which torchtitan version's names this checkpoint's keys are (VERSIONS: ``"0.3"``, ``"0.2"``)."""
    for version, key in VERSIONS.items():
        if key in names:
            return version
    keys = " or ".join(VERSIONS.values())
    raise PlanError(f"has no {keys}: not a torchtitan Llama 3 / Qwen3 checkpoint", where)


def _family(config: dict, names: set[str], legacy: bool, where: Path, config_path: Path) -> tuple[bool, bool]:
    """(permute q/k, has q/k norms) for the config's model_type, checked against the keys."""
    kind = config.get("model_type")
    if kind not in FAMILIES:
        known = ", ".join([*FAMILIES, "deepseek_v3"])
        raise PlanError(f"model_type {kind!r}: {{plan}} {PLAN} converts {known} models", config_path)
    permute, norms = FAMILIES[kind]
    biased = [k for k in BIAS_FLAGS if config.get(k) is True]
    if biased:  # transformers would build biases the weights lack and keep them at zero, without a word
        raise PlanError(f"{', '.join(biased)}: true, but torchtitan's {kind} has no biases", config_path)
    has_norms = QK_NORM[0].at(i=0).source(legacy) in names
    if has_norms != norms:
        says = "has" if has_norms else "has no"
        raise PlanError(f"{says} q_norm/k_norm weights, but the config's model_type is {kind!r}", where)
    return permute, norms


def _rows(kind: str | None, sizes: dict[str, int], name: str, where: Path) -> Rows | None:
    """The row order a q or k weight is written in: interleaved pairs to halves per head."""
    if kind is None:
        return None
    if sizes["d"] % 2:
        raise PlanError(f"{name}: head_dim {sizes['d']} is odd; RoPE pairs need an even one", where)
    return Rows.rope_halves(sizes["nh" if kind == "q" else "nkv"], sizes["d"])


def torchtitan_plan(path: str | os.PathLike, rules: Rules | None = None, hf_config: str | None = None) -> Plan:
    """Compile the Hugging Face export of the torchtitan step at ``path``. Only cast rules
    may accompany it; every key, shape and the config are checked before anything is written."""
    rules = only_casts(rules, PLAN)
    step = _step_dir(location(path))
    config_path = hf_export.find_config(step, hf_config, PLAN)
    config = load_config(config_path)
    sizes = hf_export.sizes(config, config_path)
    ckpt = open_checkpoint(step)
    if config.get("model_type") == "deepseek_v3":  # MLA, shared experts, routing bias: a layout of its own
        from streamck.plan.torchtitan.deepseek import dsv3_plan

        return dsv3_plan(ckpt, step, config, config_path, rules)
    model = {n: r for n, r in ckpt.tensors.items() if not n.startswith(TRAINING_STATE)}
    version = _version(set(model), step)
    legacy = version != "0.3"  # 0.2: the rows' legacy names
    permute, norms = _family(config, set(model), legacy, step, config_path)
    tied = config.get("tie_word_embeddings") is True
    moe = config["model_type"] in MOE_FAMILIES
    if moe:
        if legacy:
            raise PlanError(f"{{plan}} {PLAN} reads MoE models under torchtitan 0.3's names only", step)
        sizes |= moe_sizes(config, config["model_type"], config_path)
    rows = [*TOP]
    for i in range(sizes["L"]):
        layer = [*LAYER, *(QK_NORM if norms else ())]
        rows += [r.at(i=i) for r in layer if not (moe and ".mlp." in r.out)]  # MoE layers: experts instead
    head_key = HEAD.source(legacy)
    optional = {head_key} if tied else set()  # torchtitan saves the tied head under both names
    experts = [k for i in range(sizes["L"]) for k in moe_keys(i)] if moe else []
    optional |= {MOE_BIAS.format(i=i) for i in range(sizes["L"])} if moe else set()  # load balancing's
    model_name = f"a {sizes['L']}-layer torchtitan {config['model_type']} (from {config_path.name})"
    what = f"model tensors do not match {model_name}"
    expected = [r.source(legacy) for r in rows] + experts + ([] if tied else [head_key])
    compare_keys(expected, set(model) - optional, what, step)
    if not tied:
        rows.append(HEAD)
    elif head_key in model:
        _same_head(model[head_key], model[TOP[0].source(legacy)], config_path)
    outputs = [_output(model[r.source(legacy)], r, sizes, permute, step) for r in rows]
    outputs += [ref for i in range(sizes["L"] if moe else 0) for ref in moe_outputs(model, i, sizes, step)]
    summary = [
        f"torchtitan {version} {config['model_type']}: "
        + ", ".join(f"{s}={sizes[s]}" for s in ("L", "H", "nh", "nkv", "d", "I", "V", "E", "Im") if s in sizes)
        + (", tied head left out" if tied else ""),
        f"step: {step}; sizes from {config_path}",
        "q/k rows: RoPE pairs to halves" if permute else "q/k rows as stored (rotate-half already)",
    ]
    if moe:
        biases = sum(MOE_BIAS.format(i=i) in model for i in range(sizes["L"]))
        summary.append(f"MoE: {sizes['E']} experts per layer, written per expert (torchtitan's to_hf names)")
        summary += [f"expert_bias_E of {biases} layers: all zeros (routing unchanged), left out"] if biases else []
    left = _left_out(ckpt, model, len(outputs), tied and head_key in model)
    return hf_export.assemble(ckpt, outputs, rules, config, summary, left)


def _output(ref: TensorRef, row: Row, sizes: dict[str, int], permute: bool, where: Path) -> TensorRef:
    """The Hugging Face tensor of one layout row from ``ref``, its shape checked first."""
    hf_export.check(ref.name, ref, row.shape, sizes, where)
    order = _rows(row.permute, sizes, ref.name, where) if permute else None
    return select(ref, order, name=row.out)
