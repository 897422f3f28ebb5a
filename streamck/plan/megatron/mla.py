"""``--plan megatron-gpt`` for megatron-core's DeepSeek-V3 GPTModel (multi-latent attention, MoE)
as Hugging Face's DeepseekV3 (``--hf-config`` with ``model_type: deepseek_v3``).

Every tensor is a row span of one Megatron tensor, written as stored (mla_layout.py): the MLA
projections keep their rows (transformers reads Megatron's interleaved RoPE pairs with
``rope_interleave: true``), the first ``first_k_dense_replace`` layers are dense, the others MoE
with a shared expert, the router's ``expert_bias`` becomes ``mlp.gate.e_score_correction_bias``
and each routed expert is index e of its layer's [E, …] tensor (one expert in memory). Layers
are read where megatron-core put them: stacked under one key (``decoder.layers.X``, leading
axis L) when all layers are alike, one key per layer (``decoder.layers.N.X``) when
``moe_layer_freq`` mixes dense and MoE layers. The config must agree with the run's ``args``
(mla_checks.py) on sizes, dense layers, routing and RoPE.
"""

from __future__ import annotations

import re
from pathlib import Path

from streamck.errors import PlanError
from streamck.plan import hf_export
from streamck.plan.compile import Plan
from streamck.plan.contract import check_shape, compare_keys, load_config
from streamck.plan.megatron.args import Common
from streamck.plan.megatron.layout import HEAD, TOP
from streamck.plan.megatron.mla_checks import check_args, config_sizes
from streamck.plan.megatron.mla_layout import (
    ATTENTION,
    DENSE,
    EXPERTS,
    FUSED,
    HALVES,
    HF_TYPE,
    MOE,
    MTP_PREFIX,
    NO_PLACE,
    PREFIX,
    QUERY_FULL,
    QUERY_LORA,
    SYMBOLS,
)
from streamck.plan.megatron.state import state_note
from streamck.plan.rules import Rules
from streamck.source import Checkpoint, TensorRef
from streamck.source.select import Rows, select

PLAN = "megatron-gpt"
PER_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")


def mla_plan(ckpt: Checkpoint, step: Path, common: Common, keys: dict[str, TensorRef], hf_config: str | None,
             rules: Rules) -> Plan:  # fmt: skip
    """The Hugging Face DeepseekV3 export of Megatron step ``step`` (its model tensors ``keys``)."""
    args, iteration = common.args, common.iteration
    if not args:
        raise PlanError("a multi-latent-attention model needs the run's args (the common_state item) to check "
                        "its routing and RoPE against the config", step)  # fmt: skip
    config_path = hf_export.find_config(step, hf_config, PLAN)
    config = load_config(config_path)
    if config.get("model_type") != HF_TYPE:
        raise PlanError(f"model_type {config.get('model_type')!r}: a multi-latent-attention GPTModel converts to "
                        f"{HF_TYPE}", config_path)  # fmt: skip
    _refuse(keys, args, step)
    sizes = config_sizes(config, config_path)
    check_args(args, config, sizes, config_path)
    sizes["Vp"] = keys[TOP[0][1]].shape[0] if TOP[0][1] in keys and keys[TOP[0][1]].shape else sizes["V"]
    _check_vocab(args, sizes, config_path)
    tied = HEAD[1] not in keys
    if bool(config.get("tie_word_embeddings")) != tied:
        raise PlanError(f"the config's head tying is not the checkpoint's ({'tied' if tied else 'untied'})",
                        config_path)  # fmt: skip
    per_layer = any(PER_LAYER.match(k) for k in keys)
    plan = [(hf, key, part, exprs) for hf, key, part, exprs in (*TOP, *(() if tied else (HEAD,)))]
    used = {r[1] for r in plan}
    layers = []
    for i in range(sizes["L"]):
        rows = [*ATTENTION, *(QUERY_LORA if sizes["qa"] else QUERY_FULL), *(DENSE if i < sizes["K"] else MOE)]
        found = [(f"model.layers.{i}.{hf}", _where(keys, i, alts, per_layer), part, exprs)
                 for hf, alts, part, exprs in rows]  # fmt: skip
        experts = [(hf, _where(keys, i, (key,), per_layer), part, exprs) for hf, key, part, exprs in EXPERTS]
        layers.append((i, found, experts if i >= sizes["K"] else []))
        used |= {w[0] for _, w, _, _ in found} | {w[0] for _, w, _, _ in experts if i >= sizes["K"]}
    what = f"model tensors do not match a {sizes['L']}-layer DeepSeek-V3 GPTModel (from {config_path.name})"
    compare_keys(used, keys, what, step)
    outputs = [_one(keys[key], None, part, exprs, hf, sizes, step) for hf, key, part, exprs in plan]
    for i, found, experts in layers:
        outputs += [_one(keys[w[0]], w[1], part, exprs, hf, sizes, step) for hf, w, part, exprs in found]
        outputs += _experts(keys, i, experts, sizes, step)
    moe = sizes["L"] - sizes["K"]
    summary = [
        f"Megatron GPTModel (multi-latent attention), iteration {iteration}: "
        + ", ".join(f"{s}={sizes[s]}" for s in ("L", "H", "nh", "qa", "kv", "E", "Im", "V")),
        f"step: {step}; sizes from its args and {config_path}",
        f"{sizes['K']} dense layer(s), {moe} MoE with a shared expert; layers "
        + ("one key each" if per_layer else "stacked"),
        f"MoE: {sizes['E']} experts per layer, written per expert; router.expert_bias of {moe} layer(s) as "
        "mlp.gate.e_score_correction_bias",
    ]
    left = state_note(common, [n for n in ckpt.tensors if n not in keys], len(outputs))
    return hf_export.assemble(ckpt, outputs, rules, config, summary, left)


def _check_vocab(args: dict, sizes: dict[str, int], where: Path) -> None:
    """The config's vocab_size is the run's (args.vocab_size, where recorded) and fits the
    embedding's padded rows: a larger one cannot be read, a smaller one would cut the vocabulary."""
    want = args.get("vocab_size")
    if isinstance(want, int) and want != sizes["V"]:
        raise PlanError(f"vocab_size is {sizes['V']}, the checkpoint's args.vocab_size {want}", where)
    if sizes["V"] > sizes["Vp"]:
        raise PlanError(f"vocab_size {sizes['V']} exceeds the embedding's {sizes['Vp']} rows", where)


def _refuse(keys: dict[str, TensorRef], args: dict, where: Path) -> None:
    """What HF DeepseekV3 has no place for or cannot do without: MTP layers, the tensors of
    mla_layout.NO_PLACE, latents without their norms."""
    if args.get("mtp_num_layers") or any(k.startswith(MTP_PREFIX) for k in keys):
        raise PlanError(f"multi-token-prediction layers ({MTP_PREFIX}…, args.mtp_num_layers) are not converted", where)
    if args.get("qk_layernorm") is False:
        raise PlanError("args.qk_layernorm is off: Megatron's MLA then has no norm on its q / kv latents, which "
                        "HF DeepseekV3 applies (q_a_layernorm, kv_a_layernorm)", where)  # fmt: skip
    for flag, fused, why in FUSED:
        key = next((k for k in keys if k.endswith(fused)), None)
        if args.get(flag) or key:
            raise PlanError(f"{key or f'args.{flag}'}: {why}", where)
    for key in keys:
        suffix = PER_LAYER.sub("", key).removeprefix(PREFIX)
        if suffix in NO_PLACE:
            raise PlanError(f"{key}: {NO_PLACE[suffix]}, which HF DeepseekV3 has no place for", where)


def _where(
    keys: dict[str, TensorRef], i: int, alternatives: tuple[str, ...], per_layer: bool
) -> tuple[str, int | None]:
    """(Megatron key, index of layer ``i`` in it or None) of the first alternative the checkpoint
    holds, per layer or stacked; when none, the first one's name in the checkpoint's form (so that
    the key comparison names it missing)."""
    for suffix in alternatives:
        if f"{PREFIX}{i}.{suffix}" in keys:
            return f"{PREFIX}{i}.{suffix}", None
        if f"{PREFIX}{suffix}" in keys:
            return f"{PREFIX}{suffix}", i
    return (f"{PREFIX}{i}.{alternatives[0]}", None) if per_layer else (f"{PREFIX}{alternatives[0]}", i)


def _rows(part: str | None, key: str, sizes: dict[str, int]) -> Rows | None:
    """The rows of one layer's tensor: a half of a ``linear_fc1``, the unpadded vocabulary, or all."""
    if part == "vocab":
        return Rows.span(0, sizes["V"])
    if part is None:
        return None
    n = sizes[next(s for suffix, s in HALVES.items() if key.endswith(suffix))]
    return Rows.span(0, n) if part == "gate" else Rows.span(n, 2 * n)


def _check(ref: TensorRef, index: int | None, exprs: tuple, sizes: dict[str, int], where: Path) -> None:
    """``ref``'s shape (with the leading L when stacked) and dtype, else PlanError."""
    check_shape(ref.name, ref.shape, exprs if index is None else ("L", *exprs), sizes, SYMBOLS, where)
    if ref.dtype not in hf_export.FLOATS:
        raise PlanError(f"{ref.name} is {ref.dtype}; model weights are F32, BF16 or F16", where)


def _one(ref: TensorRef, index: int | None, part: str | None, exprs: tuple, name: str, sizes: dict[str, int],
         where: Path) -> TensorRef:  # fmt: skip
    """``name`` as rows of layer ``index`` of ``ref`` (all of it when None), after the checks."""
    _check(ref, index, exprs, sizes, where)
    return select(ref, _rows(part, ref.name, sizes), index=index, name=name)


def _experts(keys: dict[str, TensorRef], i: int, rows: list, sizes: dict[str, int], where: Path) -> list[TensorRef]:
    """Every routed expert of layer ``i``: expert e is index e of its [E, …] tensor (after layer
    ``i``'s index when stacked), read where its expert-parallel rank wrote it."""
    out = []
    for _, (key, index), _, exprs in rows:
        _check(keys[key], index, exprs, sizes, where)
    for e in range(sizes["E"]):
        for hf, (key, index), part, _ in rows:
            layer = keys[key] if index is None else select(keys[key], index=index)
            name = f"model.layers.{i}.{hf.format(e=e)}"
            out.append(select(layer, _rows(part, key, sizes), index=e, name=name))
    return out
