"""The non-sharded state of a Megatron ``torch_dist`` checkpoint: megatron-core's ``common_state``
item (what ``dist_checkpointing.load_common_state_dict`` returns and Megatron-LM's
``load_checkpoint`` reads) and the per-layer ``_extra_state`` objects.

``args`` is an ``argparse.Namespace`` holding the model's flags under Megatron-LM 0.19's names
(what ``--plan megatron-gpt`` reads back, and what ``check_checkpoint_args`` compares on a load
without ``--finetune``), at TP = PP = 1, with ``no_save_optim`` and ``no_save_rng`` set: the run
saved no optimizer or RNG state, so none is asked for whatever the loading run's flags.
"""

from __future__ import annotations

from pathlib import Path

from streamck.errors import PlanError
from streamck.writer.formats.megatron.moe import EXPERT_EXTRA_STATE, SHARED_EXTRA_STATE, renormalises
from streamck.writer.formats.megatron.pickles import Global, New, object_bytes
from streamck.writer.formats.megatron.table import EXTRA_STATE, Model

COMMON = "common_state/shard_0_1"  # ShardedObject("common_state", None, (1,), (0,)).unique_key
CHECKPOINT_VERSION = 3.0  # Megatron-LM's current one
# What megatron-core 0.19.2's save records of how it sharded the state (its own defaults).
CONTENT = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def _positive(value: object, key: str, where: Path | None, whole: bool = False) -> float:
    """``value``, config.json's ``key``, where it is a positive number (an integer where ``whole``)."""
    kinds = (int,) if whole else (int, float)
    if not isinstance(value, kinds) or isinstance(value, bool) or value <= 0:
        what = "a positive integer" if whole else "a positive number"
        raise PlanError(f"config.json's {key} must be {what}, not {value!r}", where)
    return value


def _theta(config: dict, where: Path | None) -> float:
    """RoPE's base: transformers 5's ``rope_parameters.rope_theta``, else the older ``rope_theta``."""
    rope = config.get("rope_parameters")
    if rope is not None and not isinstance(rope, dict):
        raise PlanError(f"config.json's rope_parameters must be an object, not {rope!r}", where)
    if rope and "rope_theta" in rope:
        return _positive(rope["rope_theta"], "rope_parameters.rope_theta", where)
    return _positive(config.get("rope_theta", 10000.0), "rope_theta", where)


def args(config: dict, m: Model, padded: int, divisible: int, dtype: str, where: Path | None = None) -> dict:
    """The model's Megatron-LM flags (argument names as ``arguments.py`` stores them); a PlanError
    naming config.json's key where a value it takes is not a number of the kind Megatron needs."""
    s, eps = m.sizes, _positive(config.get("rms_norm_eps", 1e-5), "rms_norm_eps", where)
    positions = _positive(config.get("max_position_embeddings", 4096), "max_position_embeddings", where, whole=True)
    return {
        "num_layers": s["L"], "hidden_size": s["H"], "ffn_hidden_size": s["I"], "num_attention_heads": s["nh"],
        "group_query_attention": s["nkv"] != s["nh"], "num_query_groups": s["nkv"], "kv_channels": s["d"],
        "vocab_size": s["V"], "padded_vocab_size": padded, "make_vocab_size_divisible_by": divisible,
        "untie_embeddings_and_output_weights": not m.tied, "swiglu": True, "normalization": "RMSNorm",
        "norm_epsilon": eps, "layernorm_epsilon": eps, "add_qkv_bias": m.bias, "add_bias_linear": False,
        "qk_layernorm": m.norms, "position_embedding_type": "rope", "rotary_base": _theta(config, where),
        "rotary_interleaved": False, "rotary_percent": 1.0,
        "max_position_embeddings": positions, "num_experts": None,
        "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "ckpt_format": "torch_dist",
        "no_save_optim": True, "no_save_rng": True, "bf16": dtype == "BF16", "fp16": dtype == "F16",
        **(_moe_args(config, s) if m.moe else {}),
    }  # fmt: skip


def _moe_args(config: dict, s: dict[str, int]) -> dict:
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
    empty = object_bytes(None)
    modules = (*EXTRA_STATE, *(SHARED_EXTRA_STATE if shared else ()))
    out = [(f"decoder.layers.{m}._extra_state/shard_{i}_{layers}", empty) for m in modules for i in range(layers)]
    for m in EXPERT_EXTRA_STATE if experts else ():
        grid = ((i, e) for i in range(layers) for e in range(experts))
        out += [(f"decoder.layers.{m}._extra_state/shard_{i}.{e}_{layers}.{experts}", empty) for i, e in grid]
    return out
