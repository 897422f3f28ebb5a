"""torchtitan 0.3.0 MoE layers (Qwen3-MoE) as Hugging Face's per-expert tensors.

A torchtitan MoE layer keeps its routed experts grouped: ``w1_EFD`` / ``w3_EFD`` [E, F, D]
(gate / up) and ``w2_EDF`` [E, D, F] (down), sharded by FSDP or over an expert-parallel mesh
(DCP saves the same global tensors either way). Expert e of each is index e of its first axis
(streamck.source.select), read where it lies: one expert in memory, never a grouped tensor.
torchtitan's ``to_hf`` writes the same names and drops ``expert_bias_E``; Hugging Face's
Qwen3-MoE routes with no bias, so a nonzero one (load balancing was on) is refused here.
"""

from __future__ import annotations

from pathlib import Path

from streamck.errors import PlanError
from streamck.plan import hf_export
from streamck.plan.contract import check_shape
from streamck.plan.torchtitan.layout import MOE_BIAS, MOE_EXPERTS, MOE_FAMILIES, MOE_ROUTER, MOE_SHARED
from streamck.source import TensorRef
from streamck.source.select import select

# Bytes read at a time when a routing bias is checked for zeros.
WINDOW = 1 << 20


def moe_sizes(config: dict, kind: str, config_path: Path) -> dict[str, int]:
    """E and Im of an MoE family's config; PlanError for missing sizes or dense layers among
    the MoE ones (torchtitan's Qwen3-MoE makes every layer MoE)."""
    out = {}
    for symbol, key in (("E", "num_experts"), ("Im", MOE_FAMILIES[kind])):
        value = config.get(key, config.get("num_local_experts") if symbol == "E" else None)
        if type(value) is not int or value <= 0:
            raise PlanError(f"{key} must be a positive integer, not {value!r}", config_path)
        out[symbol] = value
    if config.get("norm_topk_prob") is not True:  # else HF weighs the chosen experts otherwise, without a word
        raise PlanError("norm_topk_prob must be true: torchtitan's Qwen3-MoE renormalises its top-k routing "
                        "weights (route_norm=True)", config_path)  # fmt: skip
    if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
        raise PlanError(
            "mlp_only_layers / decoder_sparse_step make dense layers; torchtitan's are all MoE", config_path
        )
    return out


def moe_keys(i: int) -> list[str]:
    """The torchtitan keys an MoE layer must have."""
    return [row.src.format(i=i) for row in (MOE_ROUTER, *MOE_EXPERTS)]


def moe_outputs(model: dict[str, TensorRef], i: int, sizes: dict[str, int], where: Path) -> list[TensorRef]:
    """Layer ``i``'s router and every expert's gate, up and down, under Hugging Face's names,
    shapes checked; a shared expert or a nonzero routing bias is refused."""
    shared = [n for n in model if n.startswith(MOE_SHARED.format(i=i))]
    if shared:
        raise PlanError(f"{shared[0]}: a shared expert, which Hugging Face's Qwen3-MoE does not have", where)
    _check_bias(model.get(MOE_BIAS.format(i=i)), where)
    router = MOE_ROUTER.at(i=i)
    _check(model[router.src], router.shape, sizes, where)
    out = [select(model[router.src], name=router.out)]
    grouped = []
    for row in MOE_EXPERTS:
        ref = model[row.src.format(i=i)]
        _check(ref, row.shape, sizes, where)
        grouped.append((row, ref))
    for e in range(sizes["E"]):
        out += [select(ref, index=e, name=row.at(i=i, e=e).out) for row, ref in grouped]
    return out


def _check(ref: TensorRef, exprs: tuple[str, ...], sizes: dict[str, int], where: Path) -> None:
    """``ref`` is a float tensor of the shape ``exprs`` give (E, Im and the decoder's symbols)."""
    names = {**hf_export.SYMBOLS, **hf_export.DERIVED, "E": "num_experts", "Im": "moe_intermediate_size"}
    check_shape(ref.name, ref.shape, exprs, sizes, names, where)
    if ref.dtype not in hf_export.FLOATS:
        raise PlanError(f"{ref.name} is {ref.dtype}; model weights are F32, BF16 or F16", where)


def _check_bias(bias: TensorRef | None, where: Path) -> None:
    """Refuse a routing bias with any nonzero value: Hugging Face's Qwen3-MoE has no place for it,
    and the model without it routes tokens to other experts. All zeros (never updated) is dropped."""
    if bias is None:
        return
    from streamck.dtypes import BITS
    from streamck.source.reader import Reader

    item = BITS[bias.dtype] // 8
    with Reader(WINDOW - WINDOW % item) as reader:
        for window in reader.windows(bias):
            data = bytes(window)
            for k in range(0, len(data), item):  # -0.0 counts as zero: only the sign bit set
                if int.from_bytes(data[k : k + item], "little") & ~(1 << (8 * item - 1)):
                    raise PlanError(
                        f"{bias.name} holds a load-balancing routing bias (nonzero), which Hugging Face's "
                        "qwen3_moe has no place for: the converted model would route tokens differently "
                        "(torchtitan's to_hf drops it without a word)",
                        where,
                    )
