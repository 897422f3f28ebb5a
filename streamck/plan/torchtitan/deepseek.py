"""``--plan torchtitan`` for torchtitan 0.3.0's DeepSeek-V3 (``model_type: deepseek_v3``).

What torchtitan's ``DeepSeekV3StateDictAdapter.to_hf`` writes, in one streaming pass: multi-head
latent attention renamed (rows as stored: transformers' DeepseekV3 reads torchtitan's interleaved
RoPE pairs with ``rope_interleave: true``), the first ``first_k_dense_replace`` layers dense, the
others MoE with shared experts, the load-balancing bias ``expert_bias_E`` as the router's
``e_score_correction_bias`` (it has a home here, unlike Qwen3-MoE's), each routed expert index e of
its grouped tensor (one expert in memory), and MTP layers as decoder layers after the last one.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from streamck.errors import PlanError
from streamck.plan import hf_export
from streamck.plan.contract import Row, check_shape, compare_keys
from streamck.plan.rules import Rules
from streamck.plan.torchtitan.deepseek_layout import (
    ATTENTION,
    BIAS,
    DENSE,
    HEAD,
    MOE,
    MTP,
    MTP_KEYS,
    QUERY_FULL,
    QUERY_LORA,
    SYMBOLS,
    TOP,
)
from streamck.plan.torchtitan.heads import _left_out, _same_head
from streamck.plan.torchtitan.layout import MOE_EXPERTS, TRAINING_STATE
from streamck.source import Checkpoint, TensorRef
from streamck.source.select import select

MTP_PREFIX = "mtp_layers."


def _int(config: dict, key: str, where: Path, *, zero: bool = False) -> int:
    """A config size: a positive integer (or 0 where ``zero``), else PlanError naming the key."""
    value = config.get(key)
    if type(value) is not int or value < (0 if zero else 1):
        raise PlanError(f"{key} must be a {'non-negative' if zero else 'positive'} integer, not {value!r}", where)
    return value


def dsv3_sizes(config: dict, where: Path) -> dict[str, int]:
    """The shape symbols of a DeepseekV3 config (deepseek_layout.SYMBOLS) and L, K (dense
    layers); PlanError for a config this model cannot be converted to without changing it."""
    base = hf_export.sizes(config, where)
    got = {k: _int(config, k, where) for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
    got |= {k: _int(config, k, where) for k in ("n_routed_experts", "moe_intermediate_size", "n_shared_experts")}
    qa = config.get("q_lora_rank") or 0  # null or 0: one query projection
    if type(qa) is not int or qa < 0:
        raise PlanError(f"q_lora_rank must be null or a positive integer, not {qa!r}", where)
    if base["nkv"] != base["nh"]:  # else transformers repeats the latent heads it already has
        raise PlanError("num_key_value_heads must equal num_attention_heads: MLA has one key per head", where)
    if config.get("rope_interleave", True) is not True:
        raise PlanError("rope_interleave must be true: torchtitan stores RoPE pairs interleaved", where)
    if config.get("attention_bias") is True:
        raise PlanError("attention_bias: true, but torchtitan's DeepSeek-V3 has no biases", where)
    nope, rope, v = got["qk_nope_head_dim"], got["qk_rope_head_dim"], got["v_head_dim"]
    return {
        **{s: base[s] for s in ("H", "nh", "I", "V", "L")},
        "qa": qa,
        "kv": got["kv_lora_rank"],
        "dv": v,
        "E": got["n_routed_experts"],
        "Im": got["moe_intermediate_size"],
        "dq": nope + rope,
        "kvr": got["kv_lora_rank"] + rope,
        "dkv": nope + v,
        "Is": got["moe_intermediate_size"] * got["n_shared_experts"],
        "K": _int(config, "first_k_dense_replace", where, zero=True),
    }


def _mtp_count(model: set[str], config: dict, config_path: Path) -> int:
    """The MTP layers the checkpoint holds, checked against the count the config states."""
    found = len({n.split(".")[1] for n in model if n.startswith(MTP_PREFIX)})
    stated = next((config[k] for k in MTP_KEYS if k in config), None)
    if found and stated != found:
        raise PlanError(
            f"the checkpoint has {found} MTP layer(s) ({MTP_PREFIX}N), but num_nextn_predict_layers is {stated!r}",
            config_path,
        )
    return found


def _layer_rows(sizes: dict[str, int], i: int, src: str, dst: int) -> list[Row]:
    """The rows, full names filled in, of every non-expert tensor of torchtitan layer ``src``
    (``layers.3`` / ``mtp_layers.0``) written as Hugging Face layer ``dst``; ``i`` its depth."""
    rows = [*ATTENTION, *(QUERY_LORA if sizes["qa"] else QUERY_FULL)]
    rows += DENSE if i < sizes["K"] else MOE
    rows += MTP if src.startswith(MTP_PREFIX) else ()
    return [replace(r, out=f"model.layers.{dst}.{r.out}", src=f"{src}.{r.src}") for r in rows]


def dsv3_plan(ckpt: Checkpoint, step: Path, config: dict, config_path: Path, rules: Rules):
    """The Hugging Face DeepseekV3 export of torchtitan step ``step`` (opened as ``ckpt``)."""
    sizes = dsv3_sizes(config, config_path)
    model = {n: r for n, r in ckpt.tensors.items() if not n.startswith(TRAINING_STATE)}
    mtp = _mtp_count(set(model), config, config_path)
    layers = [(i, f"layers.{i}", i) for i in range(sizes["L"])]
    layers += [(sizes["L"] - 1, f"{MTP_PREFIX}{k}", sizes["L"] + k) for k in range(mtp)]  # the last layer's kind
    rows = [*TOP] + [r for i, src, dst in layers for r in _layer_rows(sizes, i, src, dst)]
    moe = [(src, dst) for i, src, dst in layers if i >= sizes["K"]]
    experts = [_expert_key(src, row) for src, _ in moe for row in MOE_EXPERTS]
    tied = config.get("tie_word_embeddings") is True
    biases = {f"{src}.{BIAS.src}": f"model.layers.{dst}.{BIAS.out}" for src, dst in moe}
    optional = set(biases) | ({HEAD.src} if tied else set())
    expected = [r.src for r in rows] + experts + ([] if tied else [HEAD.src])
    what = f"model tensors do not match a {sizes['L']}-layer torchtitan deepseek_v3 (from {config_path.name})"
    compare_keys(expected, set(model) - optional, what, step)
    if not tied:
        rows.append(HEAD)
    elif HEAD.src in model:
        _same_head(model[HEAD.src], model[TOP[0].src], config_path)
    outputs = [_output(model[r.src], r.out, r.shape, sizes, step) for r in rows]
    written = [(tt, hf) for tt, hf in biases.items() if tt in model]
    outputs += [_output(model[tt], hf, BIAS.shape, sizes, step) for tt, hf in written]
    for src, dst in moe:
        outputs += _experts(model, src, dst, sizes, step)
    summary = [
        "torchtitan 0.3 deepseek_v3: " + ", ".join(f"{s}={sizes[s]}" for s in ("L", "H", "nh", "qa", "kv", "V")),
        f"step: {step}; sizes from {config_path}",
        f"MLA rows as stored (rope_interleave); {sizes['K']} dense layer(s), {len(moe)} MoE with shared experts",
        f"MoE: {sizes['E']} experts per layer, written per expert (torchtitan's to_hf names)",
        f"expert_bias_E of {len(written)} of {len(moe)} MoE layers written as mlp.gate.e_score_correction_bias",
    ]
    summary += [f"{mtp} MTP layer(s) written as model.layers.{sizes['L']}…"] if mtp else []
    left = _left_out(ckpt, model, len(outputs), tied and HEAD.src in model)
    return hf_export.assemble(ckpt, outputs, rules, config, summary, left)


def _output(ref: TensorRef, hf_name: str, exprs: tuple, sizes: dict[str, int], where: Path) -> TensorRef:
    """``ref`` as ``hf_name``, rows as stored, after its shape and dtype are checked."""
    check_shape(ref.name, ref.shape, exprs, sizes, SYMBOLS, where)
    if ref.dtype not in hf_export.FLOATS:
        raise PlanError(f"{ref.name} is {ref.dtype}; model weights are F32, BF16 or F16", where)
    return select(ref, name=hf_name)


def _experts(model: dict[str, TensorRef], src: str, dst: int, sizes: dict[str, int], where: Path) -> list[TensorRef]:
    """Every routed expert of torchtitan layer ``src`` as Hugging Face layer ``dst``'s: expert e
    is index e of each grouped tensor, read where it lies (never the [E, …] tensor)."""
    grouped = []
    for row in MOE_EXPERTS:
        ref = model[_expert_key(src, row)]
        check_shape(ref.name, ref.shape, row.shape, sizes, SYMBOLS, where)
        if ref.dtype not in hf_export.FLOATS:
            raise PlanError(f"{ref.name} is {ref.dtype}; model weights are F32, BF16 or F16", where)
        grouped.append((row, ref))
    return [select(ref, index=e, name=row.at(i=dst, e=e).out) for e in range(sizes["E"]) for row, ref in grouped]


def _expert_key(src: str, row: Row) -> str:
    """The grouped experts' tensor of ``row`` in torchtitan layer ``src`` (``mtp_layers.0`` too):
    its ``layers.{i}.`` prefix replaced by ``src``'s."""
    return f"{src}.{row.src.split('.', 2)[2]}"
