"""What the trainer-to-Hugging-Face plans share: the model's sizes from an HF config, shape
checks against them, the output ``config.json``, and the plan assembled from the rows chosen
(the checks every built-in plan runs are streamck.plan.contract's).

The plans themselves (``torchtitan.py``, ``megatron.py``) only say which source rows make
each Hugging Face tensor (streamck.source.select); every check runs before a byte is written.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import replace
from pathlib import Path

from streamck.dtypes import TORCH_NAMES
from streamck.errors import PlanError
from streamck.plan.compile import OutputTensor, Plan, resolve_dtype
from streamck.plan.contract import check_shape
from streamck.plan.rules import Rules
from streamck.source import Checkpoint, TensorRef
from streamck.storage import location

# Shape symbols -> the Hugging Face config key behind each (named in shape errors).
SYMBOLS = {
    "H": "hidden_size",
    "nh": "num_attention_heads",
    "nkv": "num_key_value_heads",
    "d": "head_dim",
    "I": "intermediate_size",
    "L": "num_hidden_layers",
    "V": "vocab_size",
}
# What the derived symbols stand for, in shape errors.
DERIVED = {
    "QKV": "(num_attention_heads + 2 * num_key_value_heads) * head_dim",
    "Vp": "the padded vocabulary's rows",
}
REQUIRED = ("hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers", "vocab_size")
FLOATS = frozenset({"F32", "BF16", "F16"})


def find_config(step: Path, given: str | Path | None, plan: str) -> Path:
    """``given`` (``--hf-config``: the file, or the model's folder holding it), else a
    ``config.json`` in the step folder or beside it."""
    if given is not None:
        path = location(given)
        if path.is_dir():  # the model's Hugging Face folder (GGUF and MLX output take its tokenizer too)
            path = path / "config.json"
        if not path.is_file():
            raise PlanError("{hf_config}: no such file", path)
        return path
    for candidate in (step / "config.json", step.parent / "config.json"):
        if candidate.is_file():
            return candidate
    raise PlanError(
        f"{{plan}} {plan} needs the model's Hugging Face config.json for its sizes: give {{hf_config}} FILE "
        "or put config.json beside the step",
        step,
    )


def sizes(config: dict, where: Path) -> dict[str, int]:
    """The shape symbols of a decoder's config (SYMBOLS): ``num_key_value_heads`` defaults to
    the heads, ``head_dim`` to ``hidden_size / heads``. PlanError names a missing or bad key."""
    for key in REQUIRED:
        value = config.get(key)
        if type(value) is not int or value <= 0:
            what = "is missing" if key not in config else f"must be a positive integer, not {value!r}"
            raise PlanError(f"{key} {what}", where)
    out = {s: config.get(k) for s, k in SYMBOLS.items()}
    if out["nkv"] is None:
        out["nkv"] = out["nh"]
    if out["d"] is None:
        if out["H"] % out["nh"]:
            raise PlanError(f"hidden_size {out['H']} is not divisible by num_attention_heads {out['nh']}", where)
        out["d"] = out["H"] // out["nh"]
    for s in ("nkv", "d"):
        if type(out[s]) is not int or out[s] <= 0:
            raise PlanError(f"{SYMBOLS[s]} must be a positive integer, not {out[s]!r}", where)
    if out["nh"] % out["nkv"]:
        raise PlanError(f"num_attention_heads {out['nh']} is not a multiple of num_key_value_heads {out['nkv']}", where)
    return out


def check(name: str, ref: TensorRef, exprs: tuple[str, ...], symbols: dict[str, int], where: Path) -> None:
    """``ref`` is a float tensor of the shape ``exprs`` give with ``symbols``, else PlanError."""
    check_shape(name, ref.shape, exprs, symbols, {**SYMBOLS, **DERIVED}, where)
    if ref.dtype not in FLOATS:
        raise PlanError(f"{name} is {ref.dtype}; model weights are F32, BF16 or F16", where)


def output_config(config: dict, dtype: str) -> bytes:
    """``config`` with its dtype (``torch_dtype`` and/or transformers 5's ``dtype``) set to
    what the weights are written in: loaders choose the compute dtype from it."""
    out = dict(config)
    keys = [k for k in ("torch_dtype", "dtype") if k in out] or ["dtype"]
    out.update(dict.fromkeys(keys, TORCH_NAMES[dtype]))
    return (json.dumps(out, indent=2) + "\n").encode()


def assemble(
    ckpt: Checkpoint, outputs: list[TensorRef], rules: Rules, config: dict, summary: list[str], left: str
) -> Plan:
    """The plan writing ``outputs`` (named as Hugging Face names them) with ``config.json``
    beside; ``left`` says in one note what of the checkpoint is not written."""
    tensors = sorted((OutputTensor(r.name, r, resolve_dtype(rules, r)) for r in outputs), key=lambda t: t.name)
    dtype = rules.dtype or Counter(t.dtype for t in tensors).most_common(1)[0][0]  # the weights' own
    body = output_config(config, dtype)
    total = sum(math.prod(t.shape) for t in tensors)
    line = f"{len(tensors)} Hugging Face tensors, {total} parameters; config.json dtype {TORCH_NAMES[dtype]}"
    summary = [*summary, line]
    source = replace(ckpt, notices=[left])
    return Plan(tensors, {"format": "pt"}, {"config.json": body}, source=source, summary=summary)
