"""``--plan eagle4``: a trained EAGLE-4 draft in the ``LlamaForCausalLMEagle4`` serving layout.

The contract is ``docs/eagle4.md``; its tables are data in
``eagle4_layout.py``, and the checks here are written against them.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from streamck.dtypes import TORCH_NAMES
from streamck.errors import PlanError
from streamck.plan.compile import OutputTensor, Plan, resolve_dtype
from streamck.plan.eagle4_layout import (
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
from streamck.source.layout import CONSOLIDATED, HF_METADATA, hub_snapshot

# Keys only an EAGLE draft's config has: without any, the config is some other model's.
DRAFT_MARKS = ("eagle", "efficient_lm_head")


def find_checkpoint_dir(path: str | os.PathLike) -> Path:
    """The given directory if it holds config.json, else its ``model/consolidated``, else the
    config written beside a step's shards (``model/.hf_metadata``); for a Hugging Face cache
    entry or repo id, its snapshot."""
    path = hub_snapshot(Path(path))
    for candidate in (path, path / CONSOLIDATED, path / HF_METADATA):
        if (candidate / "config.json").is_file():
            return candidate
    raise PlanError(f"no config.json in {path} nor in {path / CONSOLIDATED} or {path / HF_METADATA}")


def _load_config(directory: Path) -> dict:
    path = directory / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise PlanError(f"cannot read: {e.strerror}", path) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanError(f"not valid JSON: {e}", path) from None
    if not isinstance(config, dict):
        raise PlanError("is not a JSON object", path)
    return config


def _positive_int(value: object) -> bool:
    return type(value) is int and value > 0


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
            "--plan eagle4 exports a trained EAGLE-4 draft"
        )
    for key in REQUIRED_SIZES:
        if key not in config:
            raise refuse(f"required key {key!r} is missing")
        if not _positive_int(config[key]):
            raise refuse(f"{key} must be a positive integer, not {config[key]!r}")
    for key in OPTIONAL_SIZES:
        if config.get(key) is not None and not _positive_int(config[key]):
            raise refuse(f"{key} must be a positive integer, not {config[key]!r}")
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


def table(config: dict) -> list[tuple[str, str, tuple[str, ...]]]:
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
    return {train: tuple(evaluate(e, symbols) for e in exprs) for _, train, exprs in table(config)}


def evaluate(expr: str, symbols: dict[str, int]) -> int:
    """A table expression (``H``, ``2*H``, ``nh*d``) with the config's symbols."""
    return math.prod(int(f) if f.isdigit() else symbols[f] for f in expr.split("*"))


def check_shape(
    train: str, shape: tuple[int, ...], exprs: tuple[str, ...], symbols: dict[str, int], names: dict, where: Path
) -> None:
    """Raise PlanError when ``shape`` is not the table's ``exprs`` evaluated with the config's
    ``symbols``: expected vs found, and the config keys behind (``names``: symbol -> key)."""
    want = tuple(evaluate(e, symbols) for e in exprs)
    if shape != want:
        used = dict.fromkeys(f for e in exprs for f in e.split("*") if not f.isdigit())
        behind = ", ".join(f"{u} = {names[u]}" for u in used)
        raise PlanError(
            f"{train} has shape {list(shape)}, expected {list(want)} = [{', '.join(exprs)}] from {behind}", where
        )


def serving_config(config: dict, dtype: str | None = None) -> dict:
    """The serving config.json: the copied keys present in ``config`` plus the set ones.
    A cast to ``dtype`` is reflected in ``torch_dtype`` when that key is present."""
    out = {k: config[k] for k in COPIED_CONFIG if k in config}
    out.update(SET_CONFIG)
    if dtype is not None and "torch_dtype" in out:
        out["torch_dtype"] = TORCH_NAMES[dtype]
    return dict(sorted(out.items()))


def _listing(label: str, names: list[str], limit: int = 10) -> str:
    shown = ", ".join(names[:limit]) + (f", … ({len(names)} in all)" if len(names) > limit else "")
    return f"{len(names)} {label}: {shown}"


def eagle4_plan(path: str | os.PathLike, rules: Rules | None = None) -> Plan:
    """Compile the EAGLE-4 export of the training checkpoint at ``path`` (a step directory
    or its ``model/consolidated``). Only cast rules may accompany it. Every check of
    the contract runs here, before anything is written."""
    rules = rules or Rules()
    others = sorted({r.kind for r in rules.rules if r.kind != "cast"})
    if others:
        raise PlanError(f"--plan eagle4 fixes every name; it cannot be combined with {', '.join(others)} rules")
    directory = find_checkpoint_dir(path)
    config = _load_config(directory)
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
    expected = {train: (serve, shape) for serve, train, shape in rows}
    missing = sorted(set(expected) - set(ckpt.tensors))
    unexpected = sorted(set(ckpt.tensors) - set(expected))
    if missing or unexpected:
        parts = [_listing(label, names) for label, names in (("missing", missing), ("unexpected", unexpected)) if names]
        raise PlanError("training tensors do not match the EAGLE-4 table: " + "; ".join(parts), directory)
    tensors = []
    for serve, train, exprs in rows:
        ref = ckpt.tensors[train]
        check_shape(train, ref.shape, exprs, symbols, SYMBOLS, directory)
        if ref.dtype not in FLOAT_DTYPES:
            raise PlanError(f"{train} is {ref.dtype}; EAGLE-4 tensors are F32, BF16 or F16", directory)
        tensors.append(OutputTensor(serve, ref, resolve_dtype(rules, ref)))
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
