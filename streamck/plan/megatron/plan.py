"""``--plan megatron-gpt``: a megatron-core GPTModel ``torch_dist`` checkpoint as a Hugging Face model.

Megatron's training loop leaves ``<root>/latest_checkpointed_iteration.txt`` and
``iter_NNNNNNN/`` (native DCP; ``metadata.json`` says ``torch_dist``). Its model keys are
stacked over layers (``layout.py``); each Hugging Face tensor is one layer's rows
of one of them (streamck.source.select): the fused ``linear_qkv`` split per query group
into q, k and v (and RoPE pairs reordered when Megatron rotated interleaved pairs),
``linear_fc1`` into gate and up, the padded vocabulary trimmed. The sizes come from the
checkpoint's own ``args`` (a pickled ``argparse.Namespace`` in the ``common_state`` item,
read as inert data) and, where given, a Hugging Face config (``--hf-config``, or
``config.json`` beside the step) that must agree with them; without one, the output's
``config.json`` is built from ``args``. A multi-latent-attention model (DeepSeek-V3) goes to
mla.py, which needs a DeepseekV3 config. A verl Megatron actor (its folder, ``global_step_N/``
or its run root: verl.py) is its model's dist checkpoint with the config and tokenizer from the
actor's ``huggingface/``; no ``args`` there.
"""

from __future__ import annotations

import os
from pathlib import Path

import orjson

from streamck.errors import PlanError
from streamck.plan import hf_export
from streamck.plan.compile import Plan
from streamck.plan.contract import compare_keys, load_config, only_casts
from streamck.plan.megatron.args import read_common
from streamck.plan.megatron.config import args_config, norm_epsilon
from streamck.plan.megatron.layout import (
    DENSE_MLP,
    FIXED_ARGS,
    HEAD,
    HF_DEFAULT,
    HF_MODELS,
    LAYER,
    MOE_FC1,
    MOE_FC2,
    MOE_PRE_MLP_NORM,
    MOE_ROUTER,
    MOE_SHARED,
    POST_ATTN_NORM,
    QK_NORM,
    QKV_BIAS,
    REFUSED_ARGS,
    TOP,
    TRACKER,
    TRAINING_STATE,
)
from streamck.plan.megatron.mla import mla_plan
from streamck.plan.megatron.moe import moe_config, moe_outputs, moe_sizes
from streamck.plan.megatron.state import state_note
from streamck.plan.megatron.verl import find_actor, left_out, tokenizer_files, verl_config
from streamck.plan.rules import Rules
from streamck.source import TensorRef, open_checkpoint
from streamck.source.select import Rows, select
from streamck.storage import location

PLAN = "megatron-gpt"
# multi-latent attention (--plan's DeepSeek-V3), its down-projections apart or fused (mla_layout.FUSED)
MLA_KEYS = ("self_attention.linear_kv_down_proj.weight", "self_attention.linear_qkv_down_proj.weight")
# Args whose values must equal the Hugging Face config's, by shape symbol.
CROSS_CHECKED = ("L", "H", "nh", "nkv", "d", "I")
# The arg behind each shape symbol, named when its value is refused.
ARG_NAMES = {
    "L": "num_layers",
    "H": "hidden_size",
    "nh": "num_attention_heads",
    "nkv": "num_query_groups",
    "d": "kv_channels",
    "I": "ffn_hidden_size",
    "V": "vocab_size",
    "Vp": "padded_vocab_size",
}


def step_dir(path: Path) -> Path:
    """The iteration folder: ``path`` itself, or the one its tracker file names."""
    if (path / TRACKER).is_file():
        text = (path / TRACKER).read_text().strip()
        name = "release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else None
        if name is None or not (path / name).is_dir():
            raise PlanError(f"{TRACKER} says {text!r}, and there is no such iteration folder", path)
        path = path / name
    meta = path / "metadata.json"
    if not meta.is_file():
        found = sorted(p.name for p in path.glob("iter_*") if p.is_dir())
        hint = f"; iterations here: {', '.join(found)}" if found else ""
        if any(path.glob("mp_rank_*")):
            hint = "; a legacy mp_rank_* checkpoint: save with --ckpt-format torch_dist"
        raise PlanError(f"is not a Megatron dist checkpoint (no metadata.json){hint}", path)
    try:
        backend = orjson.loads(meta.read_bytes()).get("sharded_backend")
    except (orjson.JSONDecodeError, AttributeError):
        raise PlanError("is not a JSON object", meta) from None
    if backend != "torch_dist":
        raise PlanError(f"sharded_backend {backend!r}: {{plan}} {PLAN} reads torch_dist checkpoints", meta)
    return path


def _sizes(args: dict, keys: dict[str, TensorRef], where: Path) -> dict[str, int]:
    """Shape symbols from Megatron's args (its argument names), each a positive integer that
    makes whole heads and query groups (as ``hf_export.sizes`` checks a config's)."""
    try:
        nh, H = args["num_attention_heads"], args["hidden_size"]
        out = {
            "L": args["num_layers"],
            "H": H,
            "nh": nh,
            "nkv": args.get("num_query_groups") if args.get("group_query_attention") else nh,
            "d": args.get("kv_channels"),
            "I": args.get("ffn_hidden_size"),
            "Vp": args.get("padded_vocab_size") or keys[TOP[0][1]].shape[0],
        }
    except KeyError as e:
        raise PlanError(f"the checkpoint's args lack {e.args[0]}: give {{hf_config}}", where) from None
    for s in ("L", "H", "nh", "nkv", "Vp"):
        _positive(s, out[s], where)
    if out["d"] is None and H % nh:
        raise PlanError(f"args.hidden_size {H} is not divisible by args.num_attention_heads {nh}", where)
    out["d"] = H // nh if out["d"] is None else out["d"]
    out["I"] = 4 * H if out["I"] is None else out["I"]
    out["V"] = args.get("vocab_size") or out["Vp"]
    for s in ("d", "I", "V"):
        _positive(s, out[s], where)
    if nh % out["nkv"]:
        raise PlanError(f"args.num_attention_heads {nh} is not a multiple of args.num_query_groups {out['nkv']}", where)
    if out["V"] > out["Vp"]:
        raise PlanError(f"args.vocab_size {out['V']} exceeds args.padded_vocab_size {out['Vp']}", where)
    if args.get("rotary_interleaved") and out["d"] % 2:
        raise PlanError(f"args.rotary_interleaved with an odd head dim {out['d']}: RoPE pairs need an even one", where)
    return out


def _positive(symbol: str, value: object, where: Path) -> None:
    """``value`` of the arg behind ``symbol`` is a positive int, else PlanError naming the arg."""
    if type(value) is not int or value <= 0:
        raise PlanError(f"args.{ARG_NAMES[symbol]} must be a positive integer, not {value!r}", where)


def _from_config(config: dict, keys: dict[str, TensorRef], where: Path) -> dict[str, int]:
    sizes = hf_export.sizes(config, where)
    embed = keys.get(TOP[0][1])
    return {**sizes, "Vp": embed.shape[0] if embed is not None and embed.shape else sizes["V"]}


def _agree(from_args: dict[str, int], config: dict, config_path: Path, args: dict, moe: bool = False) -> dict[str, int]:
    """The config's sizes where they equal the args'; a disagreement is refused (an MoE
    family's ``intermediate_size`` is its dense MLP's or its experts': moe_sizes checks those)."""
    mine = hf_export.sizes(config, config_path)
    for s in (s for s in CROSS_CHECKED if not (moe and s == "I")):
        if mine[s] != from_args[s]:
            key = hf_export.SYMBOLS[s]
            raise PlanError(f"{key} is {mine[s]}, the checkpoint's args say {from_args[s]}", config_path)
    if mine["V"] > from_args["Vp"]:
        raise PlanError(f"vocab_size {mine['V']} exceeds the checkpoint's {from_args['Vp']} rows", config_path)
    theta = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta"))
    for key, says, want in (("rms_norm_eps", config.get("rms_norm_eps"), norm_epsilon(args)),
                            ("rope_theta", theta, args.get("rotary_base"))):  # fmt: skip
        if says is not None and want is not None and says != want:
            raise PlanError(f"{key} is {says}, the checkpoint's args say {want}", config_path)
    return {**from_args, "V": mine["V"]}


def _same_tying(args: dict, tied: bool, where: Path) -> None:
    """The args tie the head exactly when the checkpoint holds no ``output_layer`` (a head lost with
    the last pipeline stage's file is refused, never written as tied)."""
    untie = args.get("untie_embeddings_and_output_weights")
    if untie is not None and bool(untie) == tied:
        has = "has no" if tied else "has its"
        raise PlanError(f"args.untie_embeddings_and_output_weights is {untie}, the checkpoint {has} {HEAD[1]}", where)


def _refuse_features(args: dict, keys: dict, where: Path) -> None:
    for flag, what in REFUSED_ARGS.items():
        if args.get(flag):
            raise PlanError(f"args.{flag} is set: {what}, which {{plan}} {PLAN} does not convert", where)
    for flag, want in FIXED_ARGS.items():
        if args.get(flag, want) != want:
            raise PlanError(f"args.{flag} is {args[flag]!r}: {{plan}} {PLAN} converts models with {want!r}", where)
    if any(".mixer." in k or k.startswith("decoder.layers.mamba") for k in keys):
        raise PlanError(f"a HybridModel (mixer blocks): {{plan}} {PLAN} converts GPTModel checkpoints", where)
    checks = {"swiglu": True, "normalization": "RMSNorm", "position_embedding_type": "rope"}
    for flag, want in checks.items():
        if flag in args and args[flag] != want:
            raise PlanError(f"args.{flag} is {args[flag]!r}: {{plan}} {PLAN} converts {flag} {want!r} models", where)


def rows(kind: str | None, s: dict[str, int], interleaved: bool) -> Rows | None:
    """Which rows of one layer's Megatron tensor make the Hugging Face one. Per query group
    of ``step`` rows: ``nh/nkv`` query heads, one key head, one value head; RoPE pairs are
    reordered to halves per head when Megatron rotated interleaved pairs (and so are the
    per-head q/k norm weights, applied before RoPE)."""
    if kind is None:
        return None
    if kind == "norm":
        return Rows.rope_halves(1, s["d"]) if interleaved else None
    hpg, d = s["nh"] // s["nkv"], s["d"]
    step = (hpg + 2) * d
    if kind == "vocab":
        return Rows.span(0, s["V"])
    if kind in ("gate", "up"):
        return Rows.span(0, s["I"]) if kind == "gate" else Rows.span(s["I"], 2 * s["I"])
    first, heads = {"q": (0, hpg), "k": (hpg * d, 1), "v": ((hpg + 1) * d, 1)}[kind]
    if interleaved and kind != "v":
        return Rows(first, (s["nkv"], heads, 2, d // 2), (step, d, 1, 2))
    return Rows(first, (s["nkv"], heads * d), (step, 1))


def megatron_plan(path: str | os.PathLike, rules: Rules | None = None, hf_config: str | None = None) -> Plan:
    """Compile the Hugging Face export of the Megatron GPTModel checkpoint at ``path`` (a run
    root with its tracker file, or an ``iter_*`` folder). Only cast rules may accompany it;
    every key, shape and size is checked before anything is written."""
    rules = only_casts(rules, PLAN)
    verl = find_actor(location(path))
    if verl is not None:
        hf_config = verl_config(verl, hf_config)
        if hf_config is None:
            raise PlanError(f"a verl Megatron actor saved without 'hf_model' in save_contents has no {verl.hf.name}/"
                            "config.json: give {hf_config} (the base model's config.json)", verl.actor)  # fmt: skip
    step = step_dir(verl.dist if verl else location(path))
    common = read_common(step)
    args, iteration = common.args, common.iteration
    ckpt = open_checkpoint(step)
    keys = {n: r for n, r in ckpt.tensors.items() if not n.startswith(TRAINING_STATE)}
    _refuse_features(args, keys, step)
    if args.get("multi_latent_attention") or any(k.endswith(MLA_KEYS) for k in keys):
        if verl is not None:
            raise PlanError("a verl Megatron actor with multi-latent attention (DeepSeek-V3): verl saves no Megatron "
                            "args, which this conversion checks routing and RoPE against", verl.actor)  # fmt: skip
        return mla_plan(ckpt, step, common, keys, hf_config, rules)
    moe = MOE_FC1[0] in keys or bool(args.get("num_experts"))
    sizes, config, config_path = _sizes_and_config(step, args, keys, hf_config, moe)
    bias, norms, tied = QKV_BIAS[0][1] in keys, QK_NORM[0][1] in keys, HEAD[1] not in keys
    table = [*LAYER, *(QKV_BIAS if bias else ()), *(QK_NORM if norms else ())]
    table = [r for r in table if not (moe and r[1] in DENSE_MLP)]  # MoE layers: experts instead
    if moe and MOE_PRE_MLP_NORM in keys:  # Transformer Engine's name for it
        table = [(hf, MOE_PRE_MLP_NORM if key == POST_ATTN_NORM else key, k, e) for hf, key, k, e in table]
    _same_tying(args, tied, step)
    if moe:
        found = {"q/k norms": norms, "a qkv bias": bias, "a shared expert": MOE_SHARED[0][1] in keys}
        found["a shared expert gate"] = MOE_SHARED[3][1] in keys
        if config is None and args:  # the family from the checkpoint's features and routing
            config = moe_config(args, args_config(args, sizes, bias, norms, tied), found, step)
        sizes |= moe_sizes(args, config, config_path, found, step)
    expected = {*(r[1] for r in (*TOP, *table)), *(() if tied else (HEAD[1],))}
    expected |= {MOE_ROUTER[0], MOE_FC1[0], MOE_FC2[0], *(r[1] for r in MOE_SHARED if r[1] in keys)} if moe else set()
    expected |= {POST_ATTN_NORM} if moe and {MOE_PRE_MLP_NORM, POST_ATTN_NORM} <= keys.keys() else set()  # both names
    compare_keys(expected, keys, f"model tensors do not match a GPTModel ({sizes['L']} layers)", step)
    if config is None:
        config = args_config(args, sizes, bias, norms, tied)
    elif not moe:
        _config_fits(config, bias, norms, tied, config_path)
    elif bool(config.get("tie_word_embeddings")) != tied:
        raise PlanError(f"the config's head tying is not the checkpoint's ({'tied' if tied else 'untied'})", step)
    for _, key, _, exprs in (*TOP, *table, *(() if tied else (HEAD,))):
        hf_export.check(key, keys[key], exprs, sizes, step)
    outputs = _outputs(keys, table, sizes, bool(args.get("rotary_interleaved")), tied, step)
    outputs += moe_outputs(keys, sizes, config["model_type"], step) if moe else []
    sources = [*(["its args"] if args else []), *([str(config_path)] if config_path else [])]
    features = (", qkv bias" if bias else "") + (", q/k norms" if norms else "") + (", tied head" if tied else "")
    summary = [
        f"Megatron GPTModel, iteration {iteration}: "
        + ", ".join(f"{s}={sizes[s]}" for s in ("L", "H", "nh", "nkv", "d", "I", "V", "E", "Im") if s in sizes)
        + (f" (of {sizes['Vp']} padded rows)" if sizes["Vp"] != sizes["V"] else "")
        + features,
        f"step: {step}; sizes from {' and '.join(sources)}",
    ]
    left = state_note(common, [n for n in ckpt.tensors if n not in keys], len(outputs))
    plan = hf_export.assemble(ckpt, outputs, rules, config, summary, left)
    if args and config_path is None and not args.get("vocab_size"):  # a Hugging Face tokenizer's run
        plan.source.notices.append(
            f"the args name no tokenizer vocabulary (args.vocab_size unset): all {sizes['Vp']} "
            "padded rows written; --hf-config with the tokenizer's vocab_size trims them"
        )
    if verl is not None:
        plan.side_files = {**tokenizer_files(verl), **plan.side_files}
        plan.source.notices.append(left_out(verl))
    return plan


def _sizes_and_config(
    step: Path, args: dict, keys: dict, hf_config: str | None, moe: bool = False
) -> tuple[dict[str, int], dict | None, Path | None]:
    """The shape symbols, and the Hugging Face config with its path when one is given or
    lies beside the step (required when the checkpoint holds no args)."""
    given = hf_config is not None or (step / "config.json").is_file() or (step.parent / "config.json").is_file()
    config_path = hf_export.find_config(step, hf_config, PLAN) if given or not args else None
    config = load_config(config_path) if config_path else None
    if args:
        sizes = _sizes(args, keys, step)
        sizes = _agree(sizes, config, config_path, args, moe) if config is not None else sizes
    else:
        sizes = _from_config(config, keys, config_path)
    sizes["QKV"] = (sizes["nh"] + 2 * sizes["nkv"]) * sizes["d"]
    return sizes, config, config_path


def _config_fits(config: dict, bias: bool, norms: bool, tied: bool, where: Path) -> None:
    """A given config builds the checkpoint's model: the family its features need (a
    transformers model with biases or norms the weights lack would keep them at their init,
    without a word), and the same head tying."""
    want = next((HF_MODELS[k][1] for k, on in (("qk_layernorm", norms), ("add_qkv_bias", bias)) if on), HF_DEFAULT[1])
    kind = config.get("model_type")
    fits = not norms and bool(config.get("attention_bias")) == bias if kind == "llama" else kind == want
    if not fits:
        have = "a qkv bias" if bias else "q/k norms" if norms else "no qkv bias or q/k norms"
        raise PlanError(f"model_type {kind!r} does not build this checkpoint's model ({have}: {want!r})", where)
    if bool(config.get("tie_word_embeddings")) != tied:
        says = "ties" if config.get("tie_word_embeddings") else "does not tie"
        raise PlanError(f"the config {says} the output head, the checkpoint {'has no' if tied else 'has its'} "
                        f"{HEAD[1]}", where)  # fmt: skip


def _outputs(keys: dict, table: list, sizes: dict, interleaved: bool, tied: bool, where: Path) -> list[TensorRef]:
    """Every Hugging Face tensor as rows of the Megatron ones: the top-level ones, then per layer."""
    out = [_select(keys[key], rows(kind, sizes, interleaved), None, hf, where) for hf, key, kind, _ in TOP]
    if not tied:
        out.append(_select(keys[HEAD[1]], rows(HEAD[2], sizes, interleaved), None, HEAD[0], where))
    for i in range(sizes["L"]):
        for hf, key, kind, _ in table:
            out.append(_select(keys[key], rows(kind, sizes, interleaved), i, hf.format(i=i), where))
    return out


def _select(ref: TensorRef, order: Rows | None, index: int | None, name: str, where: Path) -> TensorRef:
    """``select``, its refusal (rows or a layer outside the tensor) a PlanError naming ``ref``."""
    try:
        return select(ref, order, index=index, name=name)
    except ValueError as e:
        raise PlanError(f"{name} from {e}: the checkpoint's args do not fit its tensors", where) from None
