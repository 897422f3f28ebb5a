"""An MoE GPT's experts as megatron-core's ``SequentialMLP`` chunks: ``--plan megatron-gpt``'s MoE
rows (streamck.plan.megatron.layout MOE_ROUTER, MOE_FC1, MOE_FC2) run the other way.

Every layer is an MoE layer (Qwen3-MoE with ``decoder_sparse_step`` 1 and no ``mlp_only_layers``,
Mixtral); per layer the router is one chunk of ``mlp.router.weight`` (L, E, H), and per expert its
gate and up are two chunks of ``mlp.experts.experts.linear_fc1.weight`` (L, E, 2*Im, H), its down
one of ``linear_fc2.weight`` (L, E, H, Im): the keys megatron-core saves whatever the expert
parallelism, so a run loads them at any EP. The norm before the experts is written under both
names a layer spec gives it: the local spec's ``mlp.linear_fc1.layer_norm_weight`` and Transformer
Engine's ``pre_mlp_layernorm.weight`` (a model asks for one of them; the other is never read).
"""

from __future__ import annotations

from pathlib import Path

from streamck.errors import PlanError
from streamck.plan import OutputTensor
from streamck.plan.megatron.layout import MOE_FAMILIES, MOE_FC1, MOE_FC2, MOE_PRE_MLP_NORM, MOE_ROUTER, MOE_SHARED
from streamck.plan.moe.families import expert_count, family_of
from streamck.writer.formats.megatron.dcp import Chunk, Piece

EXPERT_EXTRA_STATE = ("mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2")
SHARED_EXTRA_STATE = ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")


def moe_sizes(config: dict, where: Path | None) -> dict[str, int]:
    """E, Im and the top k of an MoE config; a PlanError where a layer is dense or the family
    routes in a way these tables do not write."""
    kind = config["model_type"]
    fam = MOE_FAMILIES[kind]
    if config.get("decoder_sparse_step", 1) != 1 or config.get("mlp_only_layers"):
        raise PlanError(f"{kind} with dense layers (decoder_sparse_step, mlp_only_layers): {{format}} megatron "
                        "writes models whose every layer is an MoE layer", where)  # fmt: skip
    sizes = {"E": expert_count(config), "Im": config.get(fam["expert_size"]), "k": config.get("num_experts_per_tok")}
    if fam["shared_size"]:  # Qwen2-MoE's gated shared expert
        sizes["S"] = config.get(fam["shared_size"])
    for s, value in sizes.items():
        if type(value) is not int or value <= 0:
            what = {"Im": fam["expert_size"], "S": fam["shared_size"], "k": "num_experts_per_tok"}.get(
                s, "expert count"
            )
            raise PlanError(f"the config's {what} must be a positive integer, not {value!r}", where)
    return sizes


# What transformers' config class of a family takes for the key that says whether it renormalises
# (MOE_FAMILIES' "renormalise") when config.json leaves it out: Qwen2MoeConfig's and
# Qwen3MoeConfig's norm_topk_prob default to False (transformers 5.19).
RENORMALISE_DEFAULT = {"qwen2_moe": False, "qwen3_moe": False}


def renormalises(config: dict) -> bool:
    """Whether the family renormalises the top-k routing weights (Megatron's default; else
    --moe-router-pre-softmax): the config's word, else its transformers class's default."""
    kind = config["model_type"]
    says = MOE_FAMILIES[kind]["renormalise"]
    return bool(config.get(says, RENORMALISE_DEFAULT[kind])) if isinstance(says, str) else says


def _chunk(t: OutputTensor, key: str, shape: tuple[int, ...], at: tuple[int, ...], name: str):
    sizes = (1,) * (len(shape) - len(t.shape)) + t.shape
    return Piece(Chunk(key, t.dtype, shape, at, sizes), OutputTensor(name, t.source, t.dtype))


def layer_pieces(tensors: dict[str, OutputTensor], kind: str, s: dict[str, int], i: int) -> list:
    """Layer ``i``'s router and experts as chunks (the tensors' presence checked by the caller)."""
    fam = family_of(kind)
    gate, up, down = fam.experts
    block = f"model.layers.{i}.{fam.disk_block}"
    L, E, H, Im = s["L"], s["E"], s["H"], s["Im"]
    router = tensors[f"{block}.{fam.disk_suffix(fam.router)}"]
    out = [_chunk(router, MOE_ROUTER[0], (L, E, H), (i, 0, 0), f"{MOE_ROUTER[0]}[{i}]")]
    fc1, fc2 = MOE_FC1[0], MOE_FC2[0]
    for e in range(E):
        pre = f"{block}.experts.{e}"
        out.append(_chunk(tensors[f"{pre}.{gate}.weight"], fc1, (L, E, 2 * Im, H), (i, e, 0, 0), f"{fc1}[{i},{e},0]"))
        out.append(_chunk(tensors[f"{pre}.{up}.weight"], fc1, (L, E, 2 * Im, H), (i, e, Im, 0), f"{fc1}[{i},{e},{Im}]"))
        out.append(_chunk(tensors[f"{pre}.{down}.weight"], fc2, (L, E, H, Im), (i, e, 0, 0), f"{fc2}[{i},{e}]"))
    return out + (_shared(tensors, s, i) if "S" in s else [])


def _shared(tensors: dict[str, OutputTensor], s: dict[str, int], i: int) -> list[Piece]:
    """The shared expert's gate and up (two chunks of ``shared_experts.linear_fc1``), down and gate."""
    L, H, S = s["L"], s["H"], s["S"]
    shapes = {"gate": ((L, 2 * S, H), 0), "up": ((L, 2 * S, H), S), None: (None, 0)}
    out = []
    for hf, key, part, _ in MOE_SHARED:
        t = tensors[hf.format(i=i)]
        shape, at = shapes[part]
        shape = shape or (L, *t.shape)
        out.append(_chunk(t, key, shape, (i, at, 0), f"{key}[{i},{at}]"))
    return out


def names(kind: str, s: dict[str, int], i: int) -> list[tuple[str, tuple[str, ...]]]:
    """Layer ``i``'s Hugging Face router and expert names with their shapes (shape symbols)."""
    fam = family_of(kind)
    gate, up, down = fam.experts
    block = f"model.layers.{i}.{fam.disk_block}"
    out = [(f"{block}.{fam.disk_suffix(fam.router)}", ("E", "H"))]
    for e in range(s["E"]):
        pre = f"{block}.experts.{e}"
        out += [(f"{pre}.{gate}.weight", ("Im", "H")), (f"{pre}.{up}.weight", ("Im", "H")),
                (f"{pre}.{down}.weight", ("H", "Im"))]  # fmt: skip
    if "S" in s:  # MOE_SHARED's shapes for one layer: gate and up [S, H], down [H, S], its gate [1, H]
        out += [(hf.format(i=i), ("S", "H") if part else exprs[1:]) for hf, _, part, exprs in MOE_SHARED]
    return out


def te_norm(piece, i: int):
    """The post-attention norm's chunk again, under Transformer Engine's MoE name."""
    c, t = piece
    name = f"{MOE_PRE_MLP_NORM}[{i}]"
    return Piece(c._replace(key=MOE_PRE_MLP_NORM), OutputTensor(name, t.source, t.dtype))
