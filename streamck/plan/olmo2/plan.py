"""``--plan olmo2``: an OLMo-core OLMo 2 checkpoint as the ``Olmo2ForCausalLM`` that OLMo-core's
``save_hf_model`` writes: the same tensors under Hugging Face's names (a rename, per
``layout``: OLMo 2 fuses nothing and permutes no rows), in one streaming pass, with
``config.json``. Read from an OLMo-core step (``stepN/``, or a run root with ``--step``), its
``model_and_optim/``, a ``save_model_and_optim_state`` folder or ``unshard_checkpoint``'s
output; the optimizer and trainer state are left out.

The config comes from ``--hf-config`` or a ``config.json`` in or beside the step (in an
OLMo-core run root, the experiment config its ``ConfigSaverCallback`` writes): a Hugging Face
``olmo2`` config is used as it is, an OLMo-core one (its ``model`` section) converted as
OLMo-core's ``get_hf_config`` converts it. Every key and shape is checked against it first.
"""

from __future__ import annotations

import os
from pathlib import Path

from streamck.errors import PlanError
from streamck.plan import hf_export
from streamck.plan.contract import compare_keys, load_config, only_casts
from streamck.plan.olmo2.layout import ARCHITECTURE, FIXED, HEAD, LAYER, MODEL_CONFIG, REQUIRED_MODEL, TOP
from streamck.plan.rules import Rules
from streamck.source import open_checkpoint
from streamck.source.dcp.olmo import MODEL_DIR
from streamck.source.select import select
from streamck.storage import location

PLAN = "olmo2"
_MISSING = object()


def _step(path: Path) -> Path:
    """The folder a config is looked for in and beside: a step for its ``model_and_optim/``."""
    return path.parent if path.name == MODEL_DIR else path


def _get(config: dict, keys: tuple[str, ...], default: object = _MISSING) -> object:
    """The value at ``keys`` of an OLMo-core model config; ``sequence_mixer`` is called
    ``attention`` in OLMo-core before 3.0."""
    value: object = config
    for k in keys:
        if not isinstance(value, dict):
            return default
        if k == "sequence_mixer" and k not in value:
            k = "attention"
        value = value.get(k, default)
    return value


def from_olmo_core(model: dict, where: Path) -> dict:
    """The Hugging Face ``olmo2`` config of an OLMo-core model config, as ``get_hf_config``
    builds it. PlanError for another family (sliding windows: OLMo 3; RoPE scaling; MoE)."""
    wrong = [(".".join(k), want, _get(model, k, None)) for k, want in REQUIRED_MODEL.items()]
    wrong = [w for w in wrong if w[1] != w[2]]
    if wrong:
        shown = ", ".join(f"{k} is {got!r}, not {want!r}" for k, want, got in wrong)
        raise PlanError(f"not an OLMo 2 model config ({shown}): {{plan}} {PLAN} converts OLMo 2 only", where)
    for keys, what in ((("block", "sequence_mixer", "sliding_window"), "sliding-window attention (OLMo 3)"),
                       (("block", "sequence_mixer", "rope", "scaling"), "RoPE scaling"),
                       (("block", "feed_forward_moe"), "MoE blocks")):  # fmt: skip
        if _get(model, keys, None) is not None:
            raise PlanError(f"{'.'.join(keys)} is set: {what} is not converted by {{plan}} {PLAN}", where)
    out = {**ARCHITECTURE}
    for hf_key, (keys, default) in MODEL_CONFIG.items():
        value = _get(model, keys, default)
        if value is _MISSING:
            raise PlanError(f"model config has no {'.'.join(keys)}", where)
        out[hf_key] = value
    if out["num_key_value_heads"] is None:
        out["num_key_value_heads"] = out["num_attention_heads"]
    if out["rope_theta"] is None:
        raise PlanError(f"model config has no RoPE: {{plan}} {PLAN} converts OLMo 2 with RoPE only", where)
    out["rope_parameters"] = {"rope_theta": out["rope_theta"], "rope_type": "default"}
    return {**out, **FIXED}


def _config(step: Path, given: str | None) -> tuple[dict, Path]:
    """The Hugging Face config and where it came from (see the module's docstring)."""
    path = hf_export.find_config(step, given, PLAN)
    config = load_config(path)
    model = config.get("model") if isinstance(config.get("model"), dict) else config
    if "d_model" in model:
        return from_olmo_core(model, path), path
    if config.get("model_type") != "olmo2":
        raise PlanError(f"model_type {config.get('model_type')!r}: {{plan}} {PLAN} writes olmo2 models", path)
    return config, path


def olmo2_plan(path: str | os.PathLike, rules: Rules | None = None, hf_config: str | None = None):
    """Compile the ``Olmo2ForCausalLM`` export of the OLMo-core checkpoint at ``path``. Only
    cast rules may accompany it; every key, shape and the config are checked first."""
    rules = only_casts(rules, PLAN)
    path = location(path)
    config, config_path = _config(_step(path), hf_config)
    sizes = hf_export.sizes(config, config_path)
    if config.get("attention_bias") is True:
        raise PlanError(f"attention_bias: true, but {{plan}} {PLAN} converts OLMo 2 without biases", config_path)
    ckpt = open_checkpoint(path)
    tied = config.get("tie_word_embeddings") is True
    rows = [*TOP, *(r.at(i=i) for i in range(sizes["L"]) for r in LAYER), *(() if tied else (HEAD,))]
    what = f"model tensors do not match a {sizes['L']}-layer OLMo 2 (from {config_path.name})"
    compare_keys([r.src for r in rows], ckpt.tensors, what, ckpt.root)
    for r in rows:
        hf_export.check(r.src, ckpt.tensors[r.src], r.shape, sizes, ckpt.root)
    outputs = [select(ckpt.tensors[r.src], name=r.out) for r in rows]
    summary = [
        "OLMo-core OLMo 2: " + ", ".join(f"{s}={sizes[s]}" for s in ("L", "H", "nh", "nkv", "d", "I", "V"))
        + (", tied head" if tied else ""),
        f"source: {ckpt.root}; config from {config_path}",
    ]  # fmt: skip
    left = f"{len(outputs)} model tensors to write" + (f" ({'; '.join(ckpt.notices)})" if ckpt.notices else "")
    return hf_export.assemble(ckpt, outputs, rules, config, summary, left)
