"""A PEFT LoRA adapter's ``adapter_config.json``, read as PEFT 0.21.2 reads it for a merge.

Only what changes the merged weights matters here: the rank and alpha of each module
(``rank_pattern`` / ``alpha_pattern`` matched as peft.utils.other.get_pattern_key matches
them), rsLoRA's scaling, ``fan_in_fan_out``, DoRA, ``lora_bias``. The
settings whose merge streamck does not reproduce are refused, each with its reason.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from streamck.errors import PlanError

CONFIG_NAME = "adapter_config.json"
WEIGHT_NAMES = ("adapter_model.safetensors", "adapter_model.bin")

# Settings refused when set (truthy), with why: each changes what a merge means, or PEFT
# itself merges it in a way a copy of the base cannot reproduce.
REFUSED = {
    "layer_replication": "layer_replication (the merged model has layers the base does not)",
    "target_parameters": "target_parameters (LoRA on bare parameters such as MoE experts)",
    "trainable_token_indices": "trainable_token_indices (trainable token deltas)",
    "use_qalora": "QALoRA",
    "alora_invocation_tokens": "activated LoRA (aLoRA), which PEFT does not merge",
    "velora_config": "the VeLoRA variant",
    "monteclora_config": "the MonteCLoRA variant",
    "use_bdlora": "the BD-LoRA variant",
    "arrow_config": "the Arrow variant",
    "kasa_config": "the KaSA variant",
}


@dataclass(frozen=True)
class LoraConfig:
    """The merge-relevant part of an adapter_config.json."""

    path: Path
    r: int
    lora_alpha: float
    use_rslora: bool = False
    # (compiled key, value) in the file's order: PEFT takes the first key that matches.
    rank_pattern: tuple[tuple[re.Pattern, int], ...] = ()
    alpha_pattern: tuple[tuple[re.Pattern, float], ...] = ()
    fan_in_fan_out: bool = False
    use_dora: bool = False
    lora_bias: bool = False
    ensure_weight_tying: bool = False
    base_model_name_or_path: str | None = None

    def rank(self, module: str) -> int:
        """The rank PEFT gives ``module`` (its path in the base model, ``model.layers.0.mlp.up_proj``)."""
        return _matched(self.rank_pattern, module, self.r)

    def scaling(self, module: str) -> float:
        """PEFT's ``scaling[adapter]`` for ``module``: alpha / r, or alpha / sqrt(r) with rsLoRA
        (a Python float; the merge multiplies an fp32 tensor by it, which rounds it to fp32)."""
        r = self.rank(module)
        alpha = _matched(self.alpha_pattern, module, self.lora_alpha)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def _matched(patterns: tuple, module: str, default):
    """peft.utils.other.get_pattern_key: the value of the first key, in the file's order, that
    matches the end of the module path at a dot (``(.*\\.)?(key)$``); else ``default``."""
    return next((value for key, value in patterns if key.match(module)), default)


def _rank(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _alpha(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _patterns(raw: dict, field_name: str, valid, what: str, path: Path) -> tuple:
    """``raw[field_name]`` ({regex: value}) with each key compiled once as PEFT matches it."""
    given = raw.get(field_name) or {}
    if not isinstance(given, dict):
        raise PlanError(f"{field_name} is not a JSON object", path)
    out = []
    for key, value in given.items():
        if not valid(value):
            raise PlanError(f"{field_name}[{key!r}] is {value!r}, not {what}", path)
        try:
            out.append((re.compile(rf"(.*\.)?({key})$"), value))
        except re.error as e:
            raise PlanError(f"{field_name} key {key!r} is not a valid regular expression: {e}", path) from None
    return tuple(out)


def read_config(adapter: Path) -> LoraConfig:
    """Read ``adapter/adapter_config.json``; PlanError naming the file for what is refused."""
    path = adapter / CONFIG_NAME
    try:
        raw = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise PlanError(f"no {CONFIG_NAME}: not a PEFT adapter folder", adapter) from None
    except (OSError, ValueError) as e:
        raise PlanError(f"cannot read: {e}", path) from None
    if not isinstance(raw, dict):
        raise PlanError("is not a JSON object", path)
    kind = raw.get("peft_type", "LORA")
    if kind != "LORA":
        raise PlanError(f"is a {kind} adapter; {{merge_lora}} merges LoRA adapters only", path)
    for key, what in REFUSED.items():
        if raw.get(key):
            raise PlanError(f"{key} is set: {what} is not supported by {{merge_lora}}", path)
    for key, valid, what in (("r", _rank, "a positive integer"), ("lora_alpha", _alpha, "a number")):
        if key not in raw:
            raise PlanError(f"has no {key}", path)
        if not valid(raw[key]):
            raise PlanError(f"{key} is {raw[key]!r}, not {what}", path)
    name = raw.get("base_model_name_or_path")
    return LoraConfig(
        path=path,
        r=raw["r"],
        lora_alpha=raw["lora_alpha"],
        use_rslora=bool(raw.get("use_rslora")),
        rank_pattern=_patterns(raw, "rank_pattern", _rank, "a positive integer", path),
        alpha_pattern=_patterns(raw, "alpha_pattern", _alpha, "a number", path),
        fan_in_fan_out=bool(raw.get("fan_in_fan_out")),
        use_dora=bool(raw.get("use_dora")),
        lora_bias=bool(raw.get("lora_bias")),
        ensure_weight_tying=bool(raw.get("ensure_weight_tying")),
        base_model_name_or_path=name if isinstance(name, str) else None,
    )


def weights_file(adapter: Path) -> Path:
    """The adapter's tensors: adapter_model.safetensors, else adapter_model.bin."""
    for name in WEIGHT_NAMES:
        if (adapter / name).is_file():
            return adapter / name
    raise PlanError(f"holds neither {' nor '.join(WEIGHT_NAMES)}", adapter)
