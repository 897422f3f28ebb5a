"""The non-sharded state of a Megatron ``torch_dist`` checkpoint: megatron-core's ``common_state``
item (what ``dist_checkpointing.load_common_state_dict`` returns and Megatron-LM's
``load_checkpoint`` reads) and the per-layer ``_extra_state`` objects.

``args`` is an ``argparse.Namespace`` holding the model's flags under Megatron-LM 0.19's names
(what ``--plan megatron-gpt`` reads back, and what ``check_checkpoint_args`` compares on a load
without ``--finetune``), at TP = PP = 1, with ``no_save_optim`` and ``no_save_rng`` set: the run
saved no optimizer or RNG state, so none is asked for whatever the loading run's flags.
"""

from __future__ import annotations

from streamck.writer.formats.megatron.pickles import Global, New, object_bytes
from streamck.writer.formats.megatron.table import EXTRA_STATE, Model

COMMON = "common_state/shard_0_1"  # ShardedObject("common_state", None, (1,), (0,)).unique_key
CHECKPOINT_VERSION = 3.0  # Megatron-LM's current one
# What megatron-core 0.19.2's save records of how it sharded the state (its own defaults).
CONTENT = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def _theta(config: dict) -> float:
    return (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta", 10000.0))


def args(config: dict, m: Model, padded: int, divisible: int, dtype: str) -> dict:
    """The model's Megatron-LM flags (argument names as ``arguments.py`` stores them)."""
    s, eps = m.sizes, config.get("rms_norm_eps", 1e-5)
    return {
        "num_layers": s["L"], "hidden_size": s["H"], "ffn_hidden_size": s["I"], "num_attention_heads": s["nh"],
        "group_query_attention": s["nkv"] != s["nh"], "num_query_groups": s["nkv"], "kv_channels": s["d"],
        "vocab_size": s["V"], "padded_vocab_size": padded, "make_vocab_size_divisible_by": divisible,
        "untie_embeddings_and_output_weights": not m.tied, "swiglu": True, "normalization": "RMSNorm",
        "norm_epsilon": eps, "layernorm_epsilon": eps, "add_qkv_bias": m.bias, "add_bias_linear": False,
        "qk_layernorm": m.norms, "position_embedding_type": "rope", "rotary_base": _theta(config),
        "rotary_interleaved": False, "rotary_percent": 1.0,
        "max_position_embeddings": config.get("max_position_embeddings", 4096), "num_experts": None,
        "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "ckpt_format": "torch_dist",
        "no_save_optim": True, "no_save_rng": True, "bf16": dtype == "BF16", "fp16": dtype == "F16",
        **(_moe_args(config, s) if m.moe else {}),
    }  # fmt: skip


def _moe_args(config: dict, s: dict[str, int]) -> dict:
    from streamck.writer.formats.megatron.moe import renormalises

    return {"num_experts": s["E"], "moe_ffn_hidden_size": s["Im"], "moe_router_topk": s["k"],
            "moe_router_pre_softmax": not renormalises(config), "moe_router_score_function": "softmax",
            "moe_layer_freq": 1, "moe_shared_expert_intermediate_size": s.get("S"),
            "moe_shared_expert_gate": "S" in s}  # fmt: skip


def state(values: dict, iteration: int) -> dict:
    """The common state dict, ``args`` as a Namespace."""
    namespace = New(Global("argparse", "Namespace"), values)
    return {"args": namespace, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
            "content_metadata": dict(CONTENT)}  # fmt: skip


def extra_states(layers: int, experts: int = 0, shared: bool = False) -> list[tuple[str, bytes]]:
    """Each layer's ``_extra_state`` of every module in EXTRA_STATE, as ShardedObjects of global
    shape (layers,): ``decoder.layers.<module>._extra_state/shard_<i>_<layers>``; with ``experts``,
    each expert's linears' too, of global shape (layers, experts): ``shard_<i>.<e>_<layers>.<experts>``;
    with ``shared``, the shared expert's per layer."""
    from streamck.writer.formats.megatron.moe import EXPERT_EXTRA_STATE, SHARED_EXTRA_STATE

    empty = object_bytes(None)
    modules = (*EXTRA_STATE, *(SHARED_EXTRA_STATE if shared else ()))
    out = [(f"decoder.layers.{m}._extra_state/shard_{i}_{layers}", empty) for m in modules for i in range(layers)]
    for m in EXPERT_EXTRA_STATE if experts else ():
        grid = ((i, e) for i in range(layers) for e in range(experts))
        out += [(f"decoder.layers.{m}._extra_state/shard_{i}.{e}_{layers}.{experts}", empty) for i, e in grid]
    return out
