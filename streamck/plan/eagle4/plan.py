"""``--plan eagle4``: a trained EAGLE-4 draft in the ``LlamaForCausalLMEagle4`` serving layout.

The contract is ``docs/eagle4.md``; its tables are data in
``layout.py``, and the checks here are written against them.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from streamck.dtypes import TORCH_NAMES
from streamck.errors import PlanError
from streamck.plan.compile import OutputTensor, Plan, resolve_dtype
from streamck.plan.contract import (
    Row,
    check_shape,
    check_sizes,
    compare_keys,
    evaluate,
    find_checkpoint_dir,
    load_config,
    only_casts,
)
from streamck.plan.eagle4.layout import (
    AUX_LAYERS,
    BIASES,
    COPIED_CONFIG,
    FLOAT_DTYPES,
    OPTIONAL_SIZES,
    REFUSED_FLAGS,
    REQUIRED_SIZES,
    SECOND_LAYER_PREFIX,
    SET_CONFIG,
    STRUCTURE_LABELS,
    SYMBOLS,
    TENSORS,
)
from streamck.plan.rules import Rules
from streamck.source import open_checkpoint
from streamck.source.layout import HF_METADATA

# Keys only an EAGLE draft's config has: without any, the config is some other model's.
DRAFT_MARKS = ("eagle", "efficient_lm_head")


def structure(config: dict, where: Path) -> dict[str, int]:
    """Check the training config and return the shape symbols (H, T, A, nh, nkv, d, I, V, R).

    Raises PlanError saying the config is no EAGLE draft's at all (a target model's, given by
    mistake), or naming the first missing, mistyped or unsupported key.
    """

    def refuse(message: str) -> PlanError:
        return PlanError(message, where)

    if not any(k.startswith(DRAFT_MARKS) for k in config):
        kind = ", ".join(map(str, config.get("architectures") or [])) or config.get("model_type") or "a model"
        raise refuse(
            f"is not an EAGLE draft's config ({kind}, no eagle_config or efficient_lm_head keys): "
            "{plan} eagle4 exports a trained EAGLE-4 draft"
        )
    check_sizes(config, REQUIRED_SIZES, OPTIONAL_SIZES, where)
    eps = config.get("rms_norm_eps")
    if "rms_norm_eps" not in config:
        raise refuse("required key 'rms_norm_eps' is missing")
    if type(eps) not in (int, float) or not math.isfinite(eps) or eps <= 0:
        raise refuse(f"rms_norm_eps must be a positive number, not {eps!r}")
    eagle = config.get(AUX_LAYERS[0])
    aux = eagle.get(AUX_LAYERS[1]) if isinstance(eagle, dict) else None
    if not isinstance(eagle, dict) or AUX_LAYERS[1] not in eagle:
        raise refuse(f"required key '{'.'.join(AUX_LAYERS)}' is missing")
    if not (isinstance(aux, list) and aux and all(type(i) is int for i in aux)):
        raise refuse(f"{'.'.join(AUX_LAYERS)} must be a non-empty list of integers, not {aux!r}")
    for flag in ("attention_bias", "mlp_bias"):
        if flag in config and type(config[flag]) is not bool:
            raise refuse(f"{flag} must be true or false, not {config[flag]!r}")
    draft_vocab = config.get("draft_vocab_size")
    if draft_vocab is not None and draft_vocab != config["vocab_size"]:
        raise refuse(
            f"draft_vocab_size {draft_vocab!r} differs from vocab_size {config['vocab_size']}: "
            "EAGLE-4 has no vocabulary remap"
        )
    for scope, table in (("", config), ("eagle_config.", eagle)):
        for flag in REFUSED_FLAGS:
            if table.get(flag) is True:
                raise refuse(f"{scope}{flag}: true is a structure the EAGLE-4 loaders do not build")
    H, nh = config["hidden_size"], config["num_attention_heads"]
    d = config.get("head_dim")
    if d is None:
        if H % nh:
            raise refuse(f"hidden_size {H} is not divisible by num_attention_heads {nh}; set head_dim")
        d = H // nh
    return {
        "H": H,
        "T": config.get("target_hidden_size") or H,
        "A": len(aux),
        "nh": nh,
        "nkv": config["num_key_value_heads"],
        "d": d,
        "I": config["intermediate_size"],
        "V": config["vocab_size"],
        "R": config["efficient_lm_head_rank"],
    }


def table(config: dict) -> list[Row]:
    """The contract's tensor rows for this config, biases included where their flag is true."""
    rows = list(TENSORS)
    for flag, extra in BIASES.items():
        if config.get(flag) is True:
            rows += extra
    return rows


def training_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Training key -> shape that the contract expects for ``config`` (PlanError if the
    config is not a supported EAGLE-4 draft)."""
    symbols = structure(config, Path("config.json"))
    return {r.src: tuple(evaluate(e, symbols) for e in r.shape) for r in table(config)}


def serving_config(config: dict, dtype: str | None = None) -> dict:
    """The serving config.json: the copied keys present in ``config`` plus the set ones.
    A cast to ``dtype`` is reflected in ``torch_dtype`` when that key is present."""
    out = {k: config[k] for k in COPIED_CONFIG if k in config}
    out.update(SET_CONFIG)
    if dtype is not None and "torch_dtype" in out:
        out["torch_dtype"] = TORCH_NAMES[dtype]
    return dict(sorted(out.items()))


def eagle4_plan(path: str | os.PathLike, rules: Rules | None = None) -> Plan:
    """Compile the EAGLE-4 export of the training checkpoint at ``path`` (a step directory
    or its ``model/consolidated``). Only cast rules may accompany it. Every check of
    the contract runs here, before anything is written."""
    rules = only_casts(rules, "eagle4")
    directory = find_checkpoint_dir(path)
    config = load_config(directory / "config.json")
    symbols = structure(config, directory / "config.json")
    ckpt = open_checkpoint(directory if directory.name != HF_METADATA.name else path)
    second = sorted(
        n for n in ckpt.tensors if n.startswith(SECOND_LAYER_PREFIX) and not n.startswith(SECOND_LAYER_PREFIX + "0.")
    )
    if second:
        raise PlanError(
            f"{second[0]} belongs to a second draft layer; EAGLE-4 drafts have exactly one"
            + (f" ({len(second)} such tensors)" if len(second) > 1 else ""),
            directory,
        )
    rows = table(config)
    compare_keys([r.src for r in rows], ckpt.tensors, "training tensors do not match the EAGLE-4 table", directory)
    tensors = []
    for r in rows:
        ref = ckpt.tensors[r.src]
        check_shape(r.src, ref.shape, r.shape, symbols, SYMBOLS, directory)
        if ref.dtype not in FLOAT_DTYPES:
            raise PlanError(f"{r.src} is {ref.dtype}; EAGLE-4 tensors are F32, BF16 or F16", directory)
        tensors.append(OutputTensor(r.out, ref, resolve_dtype(rules, ref)))
    tensors.sort(key=lambda t: t.name)
    body = json.dumps(serving_config(config, rules.dtype), indent=2, sort_keys=True) + "\n"
    summary = [
        "EAGLE-4 draft: " + ", ".join(f"{label}={symbols[k]}" for k, label in STRUCTURE_LABELS.items()),
        f"checkpoint: {directory}",
        "serving config.json:",
        *("  " + line for line in body.splitlines()),
    ]
    return Plan(
        tensors, {"format": "pt"}, {"config.json": body.encode()}, source=ckpt, summary=summary, single_file=True
    )
