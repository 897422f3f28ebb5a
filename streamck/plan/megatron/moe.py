"""megatron-core MoE layers as a Hugging Face MoE family's per-expert tensors.

GPTModel saves its experts stacked over layers and experts: ``linear_fc1`` [L, E, 2F, H]
(gate rows, then up rows) and ``linear_fc2`` [L, E, H, F], the router [L, E, H]; expert
parallelism and tensor parallelism only change which chunks each rank's file holds. Expert e
of layer i is index i, then index e, then a row span (streamck.source.select): one expert's
slice is read at a time. The Hugging Face names are the family's of streamck.plan.moe
(``--hf-config``'s ``model_type``: Qwen3-MoE's ``mlp.experts.e.gate_proj``, Mixtral's
``block_sparse_moe.experts.e.w1``), checked against transformers' own save_pretrained.
"""

from __future__ import annotations

from pathlib import Path

from streamck.errors import PlanError
from streamck.plan import hf_export
from streamck.plan.contract import check_shape
from streamck.plan.megatron.layout import MOE_FC1, MOE_FC2, MOE_ROUTER
from streamck.plan.moe.families import expert_count, family_of
from streamck.source import TensorRef
from streamck.source.select import Rows, select

# model_type -> (has q/k norms, the config key of the experts' hidden size).
FAMILIES = {"qwen3_moe": (True, "moe_intermediate_size"), "mixtral": (False, "intermediate_size")}
NAMES = {**hf_export.SYMBOLS, **hf_export.DERIVED, "E": "num_experts", "Im": "the experts' hidden size"}


def moe_sizes(args: dict, config: dict | None, config_path: Path | None, norms: bool, where: Path) -> dict[str, int]:
    """E and Im from Megatron's args, the config's family checked against them: an MoE
    checkpoint needs ``--hf-config`` (its model_type names the family)."""
    if config is None or config_path is None:
        raise PlanError(f"an MoE model: give --hf-config with its model_type ({', '.join(FAMILIES)})", where)
    kind = config.get("model_type")
    if kind not in FAMILIES:
        raise PlanError(f"model_type {kind!r}: MoE checkpoints convert to {', '.join(FAMILIES)}", config_path)
    if FAMILIES[kind][0] != norms:
        raise PlanError(f"model_type {kind!r} {'lacks' if norms else 'has'} the checkpoint's q/k norms", config_path)
    if args.get("moe_layer_freq", 1) != 1 or config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
        raise PlanError("dense layers among the MoE ones are not converted", where)
    e, im = args.get("num_experts"), args.get("moe_ffn_hidden_size") or args.get("ffn_hidden_size")
    stated = (expert_count(config), config.get(FAMILIES[kind][1]))
    for what, mine, theirs in (("experts", e, stated[0]), ("expert hidden size", im, stated[1])):
        if mine != theirs:
            raise PlanError(f"{what}: the config says {theirs}, the checkpoint's args {mine}", config_path)
    return {"E": e, "Im": im}


def moe_outputs(keys: dict[str, TensorRef], sizes: dict[str, int], kind: str, where: Path) -> list[TensorRef]:
    """Every layer's router and experts under the family's Hugging Face names, shapes checked."""
    fam = family_of(kind)
    assert fam is not None and fam.experts is not None  # FAMILIES are all per-expert families
    router, fc1, fc2 = (keys[k] for k, _ in (MOE_ROUTER, MOE_FC1, MOE_FC2))
    for ref, (_, exprs) in zip((router, fc1, fc2), (MOE_ROUTER, MOE_FC1, MOE_FC2), strict=True):
        check_shape(ref.name, ref.shape, exprs, sizes, NAMES, where)
        if ref.dtype not in hf_export.FLOATS:
            raise PlanError(f"{ref.name} is {ref.dtype}; model weights are F32, BF16 or F16", where)
    gate, up, down = fam.experts
    im = sizes["Im"]
    out = []
    for i in range(sizes["L"]):
        block = f"model.layers.{i}.{fam.disk_block}"
        out.append(select(router, index=i, name=f"{block}.{fam.disk_suffix(fam.router)}"))
        fc1_i, fc2_i = select(fc1, index=i), select(fc2, index=i)
        for e in range(sizes["E"]):
            pre = f"{block}.experts.{e}"
            out.append(select(fc1_i, Rows.span(0, im), index=e, name=f"{pre}.{gate}.weight"))
            out.append(select(fc1_i, Rows.span(im, 2 * im), index=e, name=f"{pre}.{up}.weight"))
            out.append(select(fc2_i, index=e, name=f"{pre}.{down}.weight"))
    return out
