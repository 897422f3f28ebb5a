"""DeepSeek-V3 GPTModel checkpoints written by megatron-core 0.19.2's own ``dist_checkpointing.save``
(``torch_dist``), expert parallel 2 on 2 gloo ranks, CPU.

``torchrun --nproc-per-node 2 tests/megatron_dsv3_fixtures.py ROOT`` builds each model of MODELS
from an ``MLATransformerConfig`` with megatron-core's ``get_gpt_decoder_block_spec(config,
use_transformer_engine=False)`` (its local layer spec per layer, dense where ``moe_layer_freq`` says
0: ``MLASelfAttention`` with its q / kv RMSNorms, ``SequentialMLP`` experts, a shared expert) and the
DeepSeek-V3 router (sigmoid scores, ``moe_router_enable_expert_bias``, group-limited top-k,
``moe_router_topk_scaling_factor``), trains it one step (forward and backward, a plain SGD step,
then megatron-core's own ``_update_router_expert_bias`` of its ``finalize_model_grads``: the routing
bias becomes nonzero as a run's does), and saves ``{"model": sharded_state_dict, "args": Namespace,
"iteration": N, "checkpoint_version": 3.0}`` into ``ROOT/<name>/iter_0000010/`` with the run root's
``latest_checkpointed_iteration.txt``. Beside each: ``config.json`` (transformers' DeepseekV3Config
of the model) and ``oracle.pt``: token ids, the logits of Megatron's own EP=2 forward after the step,
and those with every router's ``expert_bias`` zeroed (so a lost bias shows in the logits).

``dsv3``: a low-rank query (``q_lora_rank``), plain RoPE, the first layer dense (``moe_layer_freq``
a list: megatron-core then saves each layer under its own key, ``decoder.layers.N.…``), 2 router
groups of which 1 is chosen. ``dsv3_yarn``: YaRN RoPE, every layer MoE (``moe_layer_freq`` 1: layers
stacked under one key each), no groups. ``dsv3_noq``: one query projection (``q_lora_rank`` None)
without ``qk_layernorm``, so no norm on the kv latent (megatron-core 0.19.2 builds a norm before
``linear_q_proj`` under ``qk_layernorm`` without ``q_lora_rank``, which needs Transformer Engine's
fused norm-linear): HF DeepseekV3 has a place for neither form. ``dsv3_te``: ``dsv3`` saved under
Transformer Engine's names for its norms (TE_NAMES: where DeepSeek-V3 runs, on TE, keep them), by
megatron-core's own ``sharded_state_dict_keys_map``. ``dsv3_tp2``: ``dsv3`` at tensor parallel 2
(_save_tp).

What it took on CPU, besides bench/megatron_ckpt.py's stand-ins (triton at import, ``torch.cuda``
synchronize/device/RNG state) and the ``allgather`` token dispatcher (``alltoall`` creates a CUDA
stream): megatron-core's local core attention does not take the ``k_channels`` / ``v_channels`` MLA
passes it (_mla_core_attention); the loss is taken on the gathered logits (megatron-core's vocab-
parallel cross entropy modifies a view of them in place under ``parallel_output=False``).
"""

from __future__ import annotations

import os
import sys
from argparse import Namespace
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))
from megatron_ckpt import (  # noqa: E402
    ITERATION,
    SEQ,
    _cuda_stand_ins,
    _import_megatron,
    fixed_tokens,
    forward,
    save_step,
    write_beside,
)

# Every model: hidden 32, 4 heads, kv_lora_rank 16, qk_head_dim (nope) 8, rope dim 4, v dim 8, dense
# MLP 48, 4 routed experts of hidden 16, a shared expert of 16, top 2 scaled by 2.5, vocab 128.
H, NH, KV, NOPE, ROPE, DV, FFN, E, F, TOPK, SCALE, V = 32, 4, 16, 8, 4, 8, 48, 4, 16, 2, 2.5, 128
# name -> layers, moe_layer_freq, q_lora_rank, router groups (num, chosen), rope_type, qk_layernorm
MODELS = {
    "dsv3": (3, [0, 1, 1], 24, (2, 1), "rope", True),
    "dsv3_yarn": (2, 1, 24, (None, None), "yarn", True),
    "dsv3_noq": (1, 1, None, (None, None), "rope", False),
}
MODELS["dsv3_te"] = MODELS["dsv3"]  # saved under Transformer Engine's norm names (TE_NAMES)
# megatron-core's own key map (a layer spec's ``sharded_state_dict_keys_map``, as its local non-MLA
# spec uses) from the local spec's norms to where the TE spec fuses them into the next linear: the
# q / kv latent norms into ``linear_q_up_proj`` / ``linear_kv_up_proj``, a dense layer's pre-MLP norm
# into ``mlp.linear_fc1`` (MoE layers keep ``pre_mlp_layernorm``, a TENorm).
TE_NAMES = {
    "self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
    "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_",
}
TE_DENSE = {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
YARN = dict(rotary_scaling_factor=4.0, original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0,
            mscale=1.0, mscale_all_dim=1.0)  # fmt: skip
BIAS_RATE = 0.05


def _config_kwargs(dims: tuple) -> dict:
    """MLATransformerConfig's fields (Megatron's args of the same names) for ``dims``."""
    layers, freq, q_lora, (groups, chosen), rope, norms = dims
    out = dict(
        num_layers=layers, hidden_size=H, num_attention_heads=NH, ffn_hidden_size=FFN, q_lora_rank=q_lora,
        kv_lora_rank=KV, qk_head_dim=NOPE, qk_pos_emb_head_dim=ROPE, v_head_dim=DV, rope_type=rope,
        rotary_base=10000, qk_layernorm=norms, moe_layer_freq=freq, moe_ffn_hidden_size=F,
        moe_shared_expert_intermediate_size=F, moe_router_topk=TOPK, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_bias_update_rate=BIAS_RATE, moe_router_num_groups=groups,
        moe_router_group_topk=chosen, moe_router_topk_scaling_factor=SCALE, moe_router_pre_softmax=False,
    )  # fmt: skip
    out |= YARN if rope == "yarn" else {}
    return out


def _mla_core_attention():
    """The one patch of megatron-core: its local ``DotProductAttention`` (the non-TE core attention)
    does not take the ``k_channels`` / ``v_channels`` that ``MultiLatentAttention`` passes it (only
    TE's does). Its forward already handles a key wider than the value (one bmm each), and its
    output width is ``kv_channels`` per head: the config sets ``kv_channels = v_head_dim``, and this
    subclass drops the two arguments. Nothing of the weights or their checkpoint changes."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)
            assert v_channels in (None, self.hidden_size_per_attention_head), v_channels

    return MLADotProductAttention


def build(dims: tuple, ep: int, te_names: bool = False, tp: int = 1):
    import torch.nn.functional as fn
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    config = MLATransformerConfig(
        **_config_kwargs(dims), gated_linear_unit=True, activation_func=fn.silu, normalization="RMSNorm",
        layernorm_epsilon=1e-6, add_bias_linear=False, use_cpu_initialization=True, init_method_std=0.1,
        hidden_dropout=0.0, attention_dropout=0.0, kv_channels=DV, num_moe_experts=E, expert_model_parallel_size=ep,
        moe_grouped_gemm=False, moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none",
        tensor_model_parallel_size=tp,
    )  # fmt: skip
    # megatron-core's block spec: a dense layer where moe_layer_freq says 0, the local (non-TE) modules.
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    freq = dims[1] if isinstance(dims[1], list) else [int(i % dims[1] == 0) for i in range(dims[0])]
    for layer, moe in zip(spec.layer_specs, freq, strict=True):
        attention = layer.submodules.self_attention.submodules
        attention.core_attention = _mla_core_attention()
        if te_names:
            layer.submodules.sharded_state_dict_keys_map = {**TE_NAMES, **({} if moe else TE_DENSE)}
    return GPTModel(
        config, transformer_layer_spec=spec, vocab_size=V, max_sequence_length=64, parallel_output=False,
        position_embedding_type="rope", share_embeddings_and_output_weights=False,
    )  # fmt: skip


def args(dims: tuple, world: int) -> Namespace:
    """What Megatron's argument parser records for the model (megatron/training/arguments.py names)."""
    import torch

    return Namespace(
        **_config_kwargs(dims), multi_latent_attention=True, group_query_attention=False, num_query_groups=1,
        kv_channels=None, padded_vocab_size=V, vocab_size=V, tensor_model_parallel_size=1,
        expert_model_parallel_size=world, pipeline_model_parallel_size=1, untie_embeddings_and_output_weights=True,
        swiglu=True, normalization="RMSNorm", norm_epsilon=1e-6, add_qkv_bias=False, add_bias_linear=False,
        position_embedding_type="rope", rotary_interleaved=False, rotary_percent=1.0, max_position_embeddings=64,
        seq_length=SEQ, num_experts=E, moe_grouped_gemm=False, params_dtype=torch.float32, bf16=False, fp16=False,
        mtp_num_layers=None, moe_shared_expert_gate=False, moe_router_load_balancing_type="none",
        num_layers_per_virtual_pipeline_stage=None,
    )  # fmt: skip


def hf_config(dims: tuple) -> dict:
    from transformers import DeepseekV3Config

    layers, freq, q_lora, (groups, chosen), rope, _ = dims
    params = {"rope_type": "default", "rope_theta": 10000.0}
    if rope == "yarn":
        params = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": YARN["rotary_scaling_factor"],
                  "original_max_position_embeddings": YARN["original_max_position_embeddings"],
                  "beta_fast": YARN["beta_fast"], "beta_slow": YARN["beta_slow"], "mscale": YARN["mscale"],
                  "mscale_all_dim": YARN["mscale_all_dim"]}  # fmt: skip
    config = DeepseekV3Config(
        vocab_size=V, hidden_size=H, intermediate_size=FFN, moe_intermediate_size=F, num_hidden_layers=layers,
        num_attention_heads=NH, num_key_value_heads=NH, n_shared_experts=1, n_routed_experts=E,
        routed_scaling_factor=SCALE, kv_lora_rank=KV, q_lora_rank=q_lora, qk_rope_head_dim=ROPE, v_head_dim=DV,
        qk_nope_head_dim=NOPE, n_group=groups or 1, topk_group=chosen or 1, num_experts_per_tok=TOPK,
        first_k_dense_replace=freq.index(1) if isinstance(freq, list) else 0, norm_topk_prob=True,
        max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_interleave=True, rope_parameters=params, attention_bias=False,
    )  # fmt: skip
    config.architectures = ["DeepseekV3ForCausalLM"]
    return config.to_dict()


def _train_step(model, config, tokens) -> None:
    """One step: the LM loss backward, SGD on the parameters (gradients of the replicated ones
    averaged over the ranks, as the DDP wrapper would), then megatron-core's expert-bias update."""
    import torch
    import torch.distributed as dist
    from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias

    model.train()
    logits = forward(model, tokens)  # the LM loss on the gathered logits (parallel_output=False)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), tokens[:, 1:].reshape(-1))
    loss.backward()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.grad is None:
                continue
            if ".experts." not in name or "shared_experts" in name:
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
            p -= 0.05 * p.grad
    _update_router_expert_bias([model], config)
    model.eval()


def _save(name: str, dims: tuple, root: Path, rank: int, world: int) -> None:
    import torch

    torch.manual_seed(0)
    model = build(dims, world, te_names=name == "dsv3_te")
    tokens = fixed_tokens(V)
    _train_step(model, model.config, tokens)
    biases = [m.expert_bias for m in model.modules() if getattr(m, "expert_bias", None) is not None]
    assert biases and all(b.abs().sum() > 0 for b in biases), "the routing bias stayed zero"
    save_step(model, args(dims, world), root / name, rank)
    with torch.no_grad():
        logits = forward(model, tokens)
        kept = [b.clone() for b in biases]
        for b in biases:
            b.zero_()
        unbiased = forward(model, tokens)
        for b, k in zip(biases, kept, strict=True):
            b.copy_(k)
    write_beside(root / name, rank, hf_config(dims), {"tokens": tokens, "logits": logits, "unbiased": unbiased})


def _save_tp(root: Path, rank: int, world: int) -> None:
    """``dsv3_tp2``: ``dsv3`` at tensor parallel 2, expert parallel 1 (each rank's rows of the
    column-parallel projections and experts, its columns of ``linear_proj`` / ``linear_fc2``), saved
    as initialised with a routing bias set by hand (MoE with TP needs sequence parallelism, whose
    torch norms refuse the CPU: no training step); its oracle is the forward of megatron-core's own
    load of it into a TP=1 model."""
    import torch
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    dims, step = MODELS["dsv3"], root / "dsv3_tp2" / f"iter_{ITERATION:07d}"
    for tp in (world, 1):
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=1)
        model_parallel_cuda_manual_seed(123)
        torch.manual_seed(0)
        model = build(dims, 1, tp=tp)
        if tp == 1:  # megatron-core's own reader, then its forward
            model.load_state_dict(dist_checkpointing.load({"model": model.sharded_state_dict()}, str(step))["model"])
            break
        routers = [m for m in model.modules() if getattr(m, "expert_bias", None) is not None]
        with torch.no_grad():
            for k, router in enumerate(routers):
                router.expert_bias.copy_(torch.linspace(-0.2, 0.2, E) * (k + 1))
        saved = args(dims, world)
        saved.tensor_model_parallel_size, saved.expert_model_parallel_size = world, 1
        save_step(model, saved, step.parent, rank)
    tokens = fixed_tokens(V)
    with torch.no_grad():
        logits = forward(model.eval(), tokens)
    write_beside(step.parent, rank, hf_config(dims), {"tokens": tokens, "logits": logits})


def main(root: Path) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    _cuda_stand_ins()
    _import_megatron()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=world)
        model_parallel_cuda_manual_seed(123)
        for name, dims in MODELS.items():
            _save(name, dims, root, rank, world)
            dist.barrier()
        _save_tp(root, rank, world)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(Path(sys.argv[1]))
