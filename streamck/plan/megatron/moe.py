"""megatron-core MoE layers as a Hugging Face MoE family's per-expert tensors.

GPTModel saves its experts stacked over layers and experts: ``linear_fc1`` [L, E, 2F, H]
(gate rows, then up rows) and ``linear_fc2`` [L, E, H, F], the router [L, E, H], a shared
expert as ``shared_experts.linear_fc1/fc2`` [L, 2S, H] / [L, H, S] with its sigmoid gate
``gate_weight`` [L, 1, H]; expert and tensor parallelism only change which chunks each rank's
file holds. Expert e of layer i is index i, then index e, then a row span
(streamck.source.select): one expert's slice is read at a time. The Hugging Face names are
the family's of streamck.plan.moe (``--hf-config``'s ``model_type``: Qwen3-MoE's
``mlp.experts.e.gate_proj``, Mixtral's ``block_sparse_moe.experts.e.w1``), which were
checked against transformers' own save_pretrained.
"""

from __future__ import annotations

from pathlib import Path

from streamck.errors import PlanError
from streamck.plan import hf_export
from streamck.plan.contract import check_shape
from streamck.plan.megatron.layout import MOE_FAMILIES, MOE_FC1, MOE_FC2, MOE_ROUTER, MOE_SHARED
from streamck.plan.moe.families import expert_count, family_of
from streamck.source import TensorRef
from streamck.source.select import Rows, select

NAMES = {
    **hf_export.SYMBOLS,
    **hf_export.DERIVED,
    "E": "num_experts",
    "Im": "the experts' hidden size",
    "S": "the shared expert's hidden size",
}


def moe_sizes(args: dict, config: dict | None, config_path: Path | None, found: dict, where: Path) -> dict[str, int]:
    """E, Im (and S with a shared expert) from Megatron's args, the config's family checked
    against them and against the checkpoint's features (``found``: q/k norms, qkv bias, a
    shared expert and its gate): an MoE checkpoint needs ``--hf-config`` naming the family."""
    if config is None:
        raise PlanError(f"an MoE model: give {{hf_config}} with its model_type ({', '.join(MOE_FAMILIES)})", where)
    config_path = config_path or where
    kind = config.get("model_type")
    if kind not in MOE_FAMILIES:
        raise PlanError(f"model_type {kind!r}: MoE checkpoints convert to {', '.join(MOE_FAMILIES)}", config_path)
    fam = MOE_FAMILIES[kind]
    for feature, has in found.items():
        if fam[feature] != has:
            raise PlanError(f"model_type {kind!r} {'has' if fam[feature] else 'has no'} {feature}, this checkpoint "
                            f"{'has' if has else 'has none'}", config_path)  # fmt: skip
    freq = args.get("moe_layer_freq", 1)  # an int, or a list with 1 for each MoE layer
    dense = freq != 1 and set(freq if isinstance(freq, list) else [0]) != {1}
    if dense or config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
        raise PlanError("dense layers among the MoE ones are not converted", where)
    sizes = {"E": args.get("num_experts"), "Im": args.get("moe_ffn_hidden_size") or args.get("ffn_hidden_size")}
    stated = {"E": expert_count(config), "Im": config.get(fam["expert_size"])}
    if found["a shared expert"]:
        sizes["S"], stated["S"] = args.get("moe_shared_expert_intermediate_size"), config.get(fam["shared_size"])
    for s, value in sizes.items():
        if value != stated[s]:
            raise PlanError(f"{NAMES[s]}: the config says {stated[s]}, the checkpoint's args {value}", config_path)
    _same_routing(args, config, fam, config_path)
    return sizes


def moe_config(args: dict, dense: dict, found: dict, where: Path) -> dict:
    """The Hugging Face config of an MoE run from its args alone (no --hf-config): the family of
    MOE_FAMILIES whose features are the checkpoint's (``found``) and that weighs the top k as
    Megatron did (renormalised unless ``moe_router_pre_softmax``), on ``dense`` (the dense config
    built from the same args)."""
    renorm = not args.get("moe_router_pre_softmax")
    kind = next((k for k, fam in MOE_FAMILIES.items() if all(fam[f] == has for f, has in found.items())
                 and fam["renormalise"] in (renorm, "norm_topk_prob")), None)  # fmt: skip
    if kind is None:
        have = ", ".join(f for f, has in found.items() if has) or "no q/k norms, qkv bias or shared expert"
        raise PlanError(f"no Hugging Face MoE family has this model's features ({have}): give {{hf_config}}", where)
    fam = MOE_FAMILIES[kind]
    config = {k: v for k, v in dense.items() if k != "attention_bias"}
    config |= {"architectures": [fam["architecture"]], "model_type": kind}
    config["num_experts_per_tok"] = args.get("moe_router_topk")
    config[fam["expert_size"]] = args.get("moe_ffn_hidden_size") or args.get("ffn_hidden_size")
    config["num_local_experts" if kind == "mixtral" else "num_experts"] = args.get("num_experts")
    if isinstance(fam["renormalise"], str):
        config[fam["renormalise"]] = renorm
    if fam["shared_size"]:
        config[fam["shared_size"]] = args.get("moe_shared_expert_intermediate_size")
    return config


def _same_routing(args: dict, config: dict, fam: dict, config_path: Path) -> None:
    """The HF family routes as Megatron did: top-k, softmax scores, and renormalised top-k
    weights exactly when Megatron took the softmax over the top k alone (not pre-softmax)."""
    topk = args.get("moe_router_topk")
    if topk is not None and topk != config.get("num_experts_per_tok"):
        says = config.get("num_experts_per_tok")
        raise PlanError(f"num_experts_per_tok is {says}, the checkpoint's args route to {topk}", config_path)
    if args.get("moe_router_score_function", "softmax") != "softmax":
        raise PlanError(f"args.moe_router_score_function {args['moe_router_score_function']!r}: HF routes by softmax",
                        config_path)  # fmt: skip
    renorm = fam["renormalise"] if isinstance(fam["renormalise"], bool) else bool(config.get(fam["renormalise"]))
    if "moe_router_pre_softmax" in args and bool(args["moe_router_pre_softmax"]) == renorm:
        how = "renormalises" if renorm else "does not renormalise"
        raise PlanError(f"the config {how} the top-k weights, Megatron's moe_router_pre_softmax says otherwise: the "
                        "model would weigh its experts differently", config_path)  # fmt: skip


def moe_outputs(keys: dict[str, TensorRef], sizes: dict[str, int], kind: str, where: Path) -> list[TensorRef]:
    """Every layer's router, experts and shared expert under the family's Hugging Face names."""
    fam = family_of(kind)
    assert fam is not None and fam.experts is not None  # MOE_FAMILIES are all per-expert families
    refs = {k: keys[k] for k, _ in (MOE_ROUTER, MOE_FC1, MOE_FC2)}
    shared = [row for row in MOE_SHARED if row[1] in keys] if "S" in sizes else []
    for key, exprs in (MOE_ROUTER, MOE_FC1, MOE_FC2, *((k, e) for _, k, _, e in shared)):
        ref = keys[key]
        check_shape(ref.name, ref.shape, exprs, sizes, NAMES, where)
        if ref.dtype not in hf_export.FLOATS:
            raise PlanError(f"{ref.name} is {ref.dtype}; model weights are F32, BF16 or F16", where)
    gate, up, down = fam.experts
    im = sizes["Im"]
    out = []
    for i in range(sizes["L"]):
        block = f"model.layers.{i}.{fam.disk_block}"
        out.append(select(refs[MOE_ROUTER[0]], index=i, name=f"{block}.{fam.disk_suffix(fam.router)}"))
        fc1_i, fc2_i = select(refs[MOE_FC1[0]], index=i), select(refs[MOE_FC2[0]], index=i)
        for e in range(sizes["E"]):
            pre = f"{block}.experts.{e}"
            out.append(select(fc1_i, Rows.span(0, im), index=e, name=f"{pre}.{gate}.weight"))
            out.append(select(fc1_i, Rows.span(im, 2 * im), index=e, name=f"{pre}.{up}.weight"))
            out.append(select(fc2_i, index=e, name=f"{pre}.{down}.weight"))
        for hf, key, part, _ in shared:
            rows = {"gate": Rows.span(0, sizes["S"]), "up": Rows.span(sizes["S"], 2 * sizes["S"])}.get(part)
            out.append(select(keys[key], rows, index=i, name=hf.format(i=i)))
    return out
