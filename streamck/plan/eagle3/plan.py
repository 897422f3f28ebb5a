"""``--plan eagle3`` and ``--plan eagle3-speculators``: a NeMo Automodel EAGLE-3 draft in
the one layout vLLM and SGLang both load, or in the speculators 0.9 format.

The tables (and the engine versions they were read from) are data in ``layout.py``;
the checks here run against them, all before anything is written.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

from streamck.dtypes import TORCH_NAMES
from streamck.errors import PlanError, UsageError, listing
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
    positive_int,
)
from streamck.plan.eagle3.aux import AuxLayers, check_aux_layers, resolve_aux_layers
from streamck.plan.eagle3.layout import (
    AUX_ID_KEYS,
    AUX_TOP,
    DTYPE_KEYS,
    ENGINE_VERSIONS,
    EXPLICIT_FLAGS,
    FC_NORM,
    LAYER_CONFIG_SET,
    LAYER_PREFIX,
    LAYER_TYPES,
    LLAMA_CONFIG,
    NORM_BEFORE_FC,
    OPTIONAL_SIZES,
    PEAGLE_CONFIG_KEYS,
    PEAGLE_TENSORS,
    PROPOSAL,
    REFUSED_FLAGS,
    REQUIRED_SIZES,
    SET_CONFIG,
    SPECULATORS_AUX_KEYS,
    SPECULATORS_SET,
    SPECULATORS_VERSION,
    STRUCTURE_LABELS,
    SYMBOLS,
    TENSORS,
    VOCAB_MAP,
)
from streamck.plan.rules import Rules
from streamck.source import open_checkpoint
from streamck.source.layout import HF_METADATA


def flag(config: dict, name: str) -> bool:
    """A norm toggle as both engines read it: ``eagle_config``'s, else the top level's; absent is false."""
    eagle = config.get("eagle_config") or {}
    return (eagle[name] if name in eagle else config.get(name)) is True


def structure(config: dict, where: Path) -> dict[str, int]:
    """Check the training config and return the shape symbols (H, T, A, nh, nkv, d, I, V, Vd)
    and n, the target's layer count (the draft config carries the target's num_hidden_layers).

    Raises PlanError naming the first missing, mistyped or refused key.
    """

    def refuse(message: str) -> PlanError:
        return PlanError(message, where)

    check_sizes(config, REQUIRED_SIZES, OPTIONAL_SIZES, where)
    if "rms_norm_eps" not in config:
        raise refuse("required key 'rms_norm_eps' is missing")
    eps = config["rms_norm_eps"]
    if type(eps) not in (int, float) or not math.isfinite(eps) or eps <= 0:
        raise refuse(f"rms_norm_eps must be a positive number, not {eps!r}")
    eagle = config.get("eagle_config")
    if eagle is not None and not isinstance(eagle, dict):
        raise refuse(f"eagle_config must be an object, not {eagle!r}")
    for scope, table in (("", config), ("eagle_config.", eagle or {})):
        for key in PEAGLE_CONFIG_KEYS:
            if table.get(key) is not None:
                raise refuse(f"{scope}{key} marks a P-EAGLE draft: {REFUSED_FLAGS['parallel_drafting']}")
        for name, reason in REFUSED_FLAGS.items():
            if table.get(name) is True:
                raise refuse(f"{scope}{name}: true is refused: {reason}")
        for name in (*REFUSED_FLAGS, *EXPLICIT_FLAGS):
            if name in table and type(table[name]) is not bool:
                raise refuse(f"{scope}{name} must be true or false, not {table[name]!r}")
    if isinstance(eagle, dict) and eagle.get("use_aux_hidden_state") is False:
        raise refuse("eagle_config.use_aux_hidden_state: false drops the fc these loaders build")
    if not positive_int(config.get("num_hidden_layers")):
        raise refuse(
            f"num_hidden_layers (the target's layer count, which the aux layer ids index) must be a positive "
            f"integer, not {config.get('num_hidden_layers')!r}"
        )
    rope = config.get("rope_parameters")
    if rope is not None and not (isinstance(rope, dict) and all(not isinstance(v, dict) for v in rope.values())):
        raise refuse(f"rope_parameters must be one flat object (the draft has one full-attention layer), not {rope!r}")
    H, nh, V = config["hidden_size"], config["num_attention_heads"], config["vocab_size"]
    d = config.get("head_dim")
    if d is None:
        if H % nh:
            raise refuse(f"hidden_size {H} is not divisible by num_attention_heads {nh}; set head_dim")
        d = H // nh
    Vd = config.get("draft_vocab_size") or V
    if Vd > V:
        raise refuse(f"draft_vocab_size {Vd} exceeds vocab_size {V}")
    return {
        "H": H,
        "T": config.get("target_hidden_size") or H,
        # Automodel sizes fc for num_aux_hidden_states (default 3) aux states (draft_llama.py).
        "A": config.get("num_aux_hidden_states") or 3,
        "nh": nh,
        "nkv": config["num_key_value_heads"],
        "d": d,
        "I": config["intermediate_size"],
        "V": V,
        "Vd": Vd,
        "n": config["num_hidden_layers"],
    }


def table(config: dict, symbols: dict[str, int]) -> list[Row]:
    """The tensor rows for this config: fc_norm rows when fc_norm, input_norm when
    norm_before_fc, d2t/t2d when Vd < V."""
    rows: list[Row] = list(TENSORS)
    if flag(config, "norm_before_fc"):
        rows.append(NORM_BEFORE_FC)
    if flag(config, "fc_norm"):
        rows += [FC_NORM.at(i=i) for i in range(symbols["A"])]
    if symbols["Vd"] < symbols["V"]:
        rows += VOCAB_MAP
    return rows


def llama_keys(config: dict, symbols: dict[str, int], dtype: str | None) -> dict:
    """The one-layer Llama keys both engines build the draft from (through transformers 5's
    LlamaConfig): the copied sizes, ``dtype`` (a --dtype cast's, else the config's under either
    name), ``rope_parameters`` (a transformers-4 config's rope_theta and rope_scaling folded in
    as transformers 5 folds them) and one ``layer_types`` entry."""
    out = {k: config[k] for k in LLAMA_CONFIG if k in config}
    named = next((config[k] for k in DTYPE_KEYS if config.get(k) is not None), None)
    if dtype is not None or named is not None:
        out["dtype"] = TORCH_NAMES[dtype] if dtype is not None else named
    rope = config.get("rope_parameters")
    if rope is None and (config.get("rope_theta") is not None or config.get("rope_scaling")):
        rope = dict(config.get("rope_scaling") or {})
        rope.setdefault("rope_type", rope.get("type", "default"))
        if config.get("rope_theta") is not None:
            rope.setdefault("rope_theta", config["rope_theta"])
    if rope is not None:
        out["rope_parameters"] = dict(sorted(rope.items()))
    out["layer_types"] = list(LAYER_TYPES)
    out["head_dim"] = symbols["d"]
    # Both engines size fc by this first (then by eagle_config's ids): one more explicit key.
    out["num_aux_hidden_states"] = symbols["A"]
    return out


def serving_config(config: dict, symbols: dict[str, int], aux: AuxLayers, dtype: str | None = None) -> dict:
    """The native serving config.json (vLLM and SGLang), built from scratch: the aux ids under
    each engine's key in its own convention (AUX_ID_KEYS)."""
    out = llama_keys(config, symbols, dtype)
    out |= {name: flag(config, name) for name in EXPLICIT_FLAGS}
    out |= {"draft_vocab_size": symbols["Vd"], "target_hidden_size": symbols["T"]}
    aux.write(out, AUX_ID_KEYS)
    out.update(SET_CONFIG)
    return dict(sorted(out.items()))


def speculators_config(
    config: dict, symbols: dict[str, int], aux: AuxLayers, verifier: str, dtype: str | None = None
) -> dict:
    """The speculators 0.9 config.json: Eagle3SpeculatorConfig's fields, all written out, the
    aux ids in vLLM's convention."""
    layer = llama_keys(config, symbols, dtype)
    layer.update(LAYER_CONFIG_SET)
    out = {
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": PROPOSAL["proposal_type"],
            "proposal_methods": [dict(PROPOSAL)],
            "verifier": {"architectures": [], "name_or_path": verifier},
        },
        "transformer_layer_config": dict(sorted(layer.items())),
        "draft_vocab_size": symbols["Vd"],
        "target_hidden_size": symbols["T"],
        **{name: flag(config, name) for name in EXPLICIT_FLAGS},
    }
    aux.write(out, SPECULATORS_AUX_KEYS)
    if "dtype" in layer:
        out["dtype"] = layer["dtype"]
    out.update(SPECULATORS_SET)
    return dict(sorted(out.items()))


def _check_tensors(names: set[str], rows: list[Row], symbols: dict[str, int], where: Path) -> None:
    """Refuse P-EAGLE tensors, a second layer, biases, a vocab map that disagrees with the
    config, then any missing or unexpected key (listed together)."""
    peagle = sorted(n for n in names if n in PEAGLE_TENSORS)
    if peagle:
        raise PlanError(f"{peagle[0]} marks a P-EAGLE draft: {REFUSED_FLAGS['parallel_drafting']}", where)
    second = sorted(n for n in names if n.startswith(LAYER_PREFIX) and not n.startswith(LAYER_PREFIX + "0."))
    if second:
        raise PlanError(
            f"{second[0]} belongs to a second draft layer; these loaders build exactly one"
            + (f" ({len(second)} such tensors)" if len(second) > 1 else ""),
            where,
        )
    biases = sorted(n for n in names if n.endswith(".bias"))
    if biases:
        raise PlanError(
            f"{len(biases)} bias tensors: {listing(biases)}: SGLang builds the EAGLE-3 layer without biases and "
            "ignores them silently",
            where,
        )
    V, Vd = symbols["V"], symbols["Vd"]
    maps = [r.src for r in VOCAB_MAP]
    present = [m for m in maps if m in names]
    if Vd == V and present:
        raise PlanError(
            f"{' and '.join(present)} present but draft_vocab_size equals vocab_size ({V}): "
            "a draft without a reduced vocabulary has no vocab map",
            where,
        )
    absent = [m for m in maps if m not in names]
    if Vd < V and absent:
        raise PlanError(
            f"{' and '.join(absent)} missing with draft_vocab_size {Vd} < vocab_size {V}: vLLM would keep "
            "a zero draft-to-target map and SGLang no hot-token map",
            where,
        )
    expected = {r.src for r in rows}
    compare_keys(expected, names, "training tensors do not match the EAGLE-3 table", where)


def _compile(
    path: str | os.PathLike, rules: Rules | None, name: str, aux_layer_ids: Sequence[int] | str | None
) -> tuple[Path, dict, dict, AuxLayers, list, object]:
    rules = only_casts(rules, name)
    directory = find_checkpoint_dir(path)
    config = load_config(directory / "config.json")
    symbols = structure(config, directory / "config.json")
    aux = resolve_aux_layers(config, path, directory, aux_layer_ids, symbols["n"])
    top, reason = AUX_TOP[name]
    check_aux_layers(aux, symbols["A"], symbols["n"], top, reason, directory / "config.json")
    ckpt = open_checkpoint(directory if directory.name != HF_METADATA.name else path)
    rows = table(config, symbols)
    _check_tensors(set(ckpt.tensors), rows, symbols, directory)
    tensors = []
    for r in rows:
        ref = ckpt.tensors[r.src]
        want = tuple(evaluate(e, symbols) for e in r.shape)
        if r.src == "lm_head.weight" and ref.shape[:1] != want[:1]:
            raise PlanError(
                f"lm_head.weight has {ref.shape[0] if ref.shape else 0} rows, draft_vocab_size is "
                f"{symbols['Vd']} (shape {list(ref.shape)}, expected {list(want)})",
                directory,
            )
        check_shape(r.src, ref.shape, r.shape, symbols, SYMBOLS, directory)
        if ref.dtype not in r.dtypes:
            raise PlanError(f"{r.src} is {ref.dtype}; expected {' or '.join(r.dtypes)}", directory)
        tensors.append(OutputTensor(r.out, ref, resolve_dtype(rules, ref)))
    tensors.sort(key=lambda t: t.name)
    return directory, config, symbols, aux, tensors, ckpt


def _plan(tensors, ckpt, directory: Path, symbols: dict, note: str, body: dict, title: str) -> Plan:
    text = json.dumps(body, indent=2, sort_keys=True) + "\n"
    summary = [
        f"{title}: " + ", ".join(f"{label}={symbols[k]}" for k, label in STRUCTURE_LABELS.items()),
        f"checkpoint: {directory}",
        note,
        "config.json:",
        *("  " + line for line in text.splitlines()),
    ]
    return Plan(
        tensors,
        {"format": "pt"},
        {"config.json": text.encode()},
        source=ckpt,
        summary=summary,
        single_file=True,
        notices=[note, *_dtype_notes(tensors, body)],
    )


def _dtype_notes(tensors: list[OutputTensor], body: dict) -> list[str]:
    """A note where weights are written in a dtype other than the served config's (Automodel saves
    float32 weights under the target's bfloat16; no --dtype cast): vLLM 0.32 casts each as it loads
    it, with a warning a weight (tests/test_vllm.py)."""
    served = body.get("dtype")
    stored = sorted({t.dtype for t in tensors if TORCH_NAMES.get(t.dtype) != served})
    short = {name: dtype for dtype, name in TORCH_NAMES.items()}.get(served)
    if not stored or short is None:
        return []
    return [
        f"the weights are {', '.join(stored)} and the served config says {served}: vLLM casts each as it "
        f"loads it, warning once a weight; --dtype {short.lower()} writes them as served"
    ]


def eagle3_plan(
    path: str | os.PathLike,
    rules: Rules | None = None,
    *,
    verifier: str | None = None,
    aux_layer_ids: Sequence[int] | str | None = None,
) -> Plan:
    """Compile the native EAGLE-3 export (``LlamaForCausalLMEagle3``, loaded by vLLM and
    SGLang) of the Automodel draft at ``path``: a step directory, its ``model/consolidated``
    or a step holding only shards. ``aux_layer_ids`` (Automodel's convention: the outputs of
    those target layers) overrides the ids the step records. Only cast rules may accompany it."""
    if verifier is not None:
        raise UsageError("{verifier} applies to {plan} eagle3-speculators only")
    directory, config, symbols, aux, tensors, ckpt = _compile(path, rules, "eagle3", aux_layer_ids)
    body = serving_config(config, symbols, aux, (rules or Rules()).dtype)
    note = aux.note(AUX_ID_KEYS)
    return _plan(tensors, ckpt, directory, symbols, note, body, f"EAGLE-3 draft for {ENGINE_VERSIONS}")


def eagle3_speculators_plan(
    path: str | os.PathLike,
    rules: Rules | None = None,
    *,
    verifier: str | None = None,
    aux_layer_ids: Sequence[int] | str | None = None,
) -> Plan:
    """Compile the same tensors under a speculators 0.9 config whose verifier is
    ``verifier`` (a Hugging Face id or path; required)."""
    if not verifier or not isinstance(verifier, str) or not verifier.strip():
        raise UsageError("{plan} eagle3-speculators needs {verifier} ORG/NAME (the target model)")
    directory, config, symbols, aux, tensors, ckpt = _compile(path, rules, "eagle3-speculators", aux_layer_ids)
    if flag(config, "norm_before_fc") and flag(config, "fc_norm"):
        raise PlanError(
            f"norm_before_fc and fc_norm are both true: speculators {SPECULATORS_VERSION} takes one or the "
            "other; use {plan} eagle3",
            directory / "config.json",
        )
    if symbols["T"] != symbols["H"]:
        raise PlanError(
            f"target_hidden_size {symbols['T']} differs from hidden_size {symbols['H']}: speculators "
            f"{SPECULATORS_VERSION} builds fc and fc_norm on hidden_size; use {{plan}} eagle3",
            directory / "config.json",
        )
    body = speculators_config(config, symbols, aux, verifier, (rules or Rules()).dtype)
    note = aux.note(SPECULATORS_AUX_KEYS)
    return _plan(tensors, ckpt, directory, symbols, note, body, f"EAGLE-3 draft for speculators {SPECULATORS_VERSION}")
