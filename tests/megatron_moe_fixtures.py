"""MoE GPTModel checkpoints written by megatron-core 0.19.2's own ``dist_checkpointing.save``
(``torch_dist``), expert parallel 2 on 2 gloo ranks, CPU.

``python tests/megatron_moe_fixtures.py ROOT`` builds each model of MODELS with megatron-core's
local layer spec for MoE (``get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)``:
``SequentialMLP`` experts, a top-2 softmax router), ``expert_model_parallel_size=2`` (each rank
holds two of the four experts), and saves ``{"model": sharded_state_dict, "args": Namespace,
"iteration": N, "checkpoint_version": 3.0}`` into ``ROOT/<name>/iter_0000010/`` with the run
root's ``latest_checkpointed_iteration.txt``, as Megatron's training loop does. Beside each:
``config.json``, the Hugging Face config of the family (Qwen3-MoE with q/k norms, Mixtral
without), and ``oracle.pt``: token ids and the logits of Megatron's own EP=2 forward.
``qwen3_moe_tp2`` is the Qwen3-MoE model saved at tensor parallel 2 instead (see _save_tp),
its oracle the forward of megatron-core's own load of it at TP=1.

Stand-ins as bench/megatron_ckpt.py (triton at import, ``torch.cuda`` synchronize/device/RNG
state); the ``allgather`` token dispatcher, since ``alltoall`` creates a CUDA stream.
"""

from __future__ import annotations

import json
import os
import sys
from argparse import Namespace
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))
from megatron_ckpt import (  # noqa: E402
    ITERATION,
    SEQ,
    WORLD,
    _cuda_stand_ins,
    _import_megatron,
    fixed_tokens,
    forward,
    save_step,
    write_beside,
)

# name -> (q/k norms, HF family); every model: 2 layers, hidden 32, 4 heads, 2 groups, head dim 8,
# 4 experts of hidden 24, top 2, vocab 128. Qwen2-MoE adds a qkv bias and a gated shared expert
# of hidden 16, and routes as its norm_topk_prob=False does: softmax over every expert, then the
# top 2 (Megatron's moe_router_pre_softmax); the others renormalise the top 2 (softmax over them).
MODELS = {
    "qwen3_moe": (True, "qwen3_moe"),
    "mixtral": (False, "mixtral"),
    "qwen2_moe": (False, "qwen2_moe"),
    "mixtral_te": (False, "mixtral"),
}
# Saved under Transformer Engine's MoE names: its layer spec keeps the norm before the experts a
# module of its own (gpt_layer_specs.py: ``pre_mlp_layernorm=TENorm if num_experts``, no key map
# for it), where the local spec maps it to the dense ``mlp.linear_fc1.layer_norm_weight``. TE
# needs CUDA: the local spec without that one entry of its key map saves what TE's does.
TE_NAMES = {"mixtral_te"}
SHARED = 16
L, H, NH, NKV, D, E, F, TOPK, V = 2, 32, 4, 2, 8, 4, 24, 2, 128


def build(qk: bool, ep: int, family: str, tp: int = 1, te_names: bool = False):
    import torch.nn.functional as fn
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=L, hidden_size=H, num_attention_heads=NH, num_query_groups=NKV, kv_channels=D,
        ffn_hidden_size=64, gated_linear_unit=True, activation_func=fn.silu, normalization="RMSNorm",
        layernorm_epsilon=1e-6, add_bias_linear=False, use_cpu_initialization=True, init_method_std=0.1,
        hidden_dropout=0.0, attention_dropout=0.0, qk_layernorm=qk, num_moe_experts=E, moe_ffn_hidden_size=F,
        moe_router_topk=TOPK, expert_model_parallel_size=ep, moe_grouped_gemm=False,
        moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none", **_qwen2(family),
        tensor_model_parallel_size=tp,
    )  # fmt: skip
    spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False, normalization="RMSNorm", qk_layernorm=qk)
    if te_names:
        del spec.submodules.sharded_state_dict_keys_map["pre_mlp_layernorm."]
    return GPTModel(
        config, transformer_layer_spec=spec, vocab_size=V, max_sequence_length=64, parallel_output=False,
        position_embedding_type="rope", rotary_base=1000000, share_embeddings_and_output_weights=False,
    )  # fmt: skip


def _qwen2(family: str) -> dict:
    """Qwen2-MoE's extras in TransformerConfig's names (and its routing: see MODELS)."""
    if family != "qwen2_moe":
        return {}
    return dict(add_qkv_bias=True, moe_shared_expert_intermediate_size=SHARED, moe_shared_expert_gate=True,
                moe_router_pre_softmax=True)  # fmt: skip


def args(qk: bool, family: str) -> Namespace:
    """What Megatron's argument parser records for the model (megatron/training/arguments.py names)."""
    import torch

    out = Namespace(
        num_layers=L, hidden_size=H, ffn_hidden_size=64, num_attention_heads=NH, group_query_attention=True,
        num_query_groups=NKV, kv_channels=D, padded_vocab_size=V, vocab_size=V, tensor_model_parallel_size=1,
        expert_model_parallel_size=WORLD, pipeline_model_parallel_size=1, untie_embeddings_and_output_weights=True,
        swiglu=True, normalization="RMSNorm", norm_epsilon=1e-6, add_qkv_bias=False, add_bias_linear=False,
        position_embedding_type="rope", rotary_base=1000000, rotary_interleaved=False, rotary_percent=1.0,
        max_position_embeddings=64, seq_length=SEQ, qk_layernorm=qk, num_experts=E, moe_ffn_hidden_size=F,
        moe_router_topk=TOPK, moe_grouped_gemm=False, moe_layer_freq=1, moe_router_score_function="softmax",
        params_dtype=torch.float32, bf16=False, fp16=False, moe_router_pre_softmax=False,
        moe_shared_expert_intermediate_size=None,
    )  # fmt: skip
    if family == "qwen2_moe":
        out.add_qkv_bias, out.moe_shared_expert_intermediate_size, out.moe_router_pre_softmax = True, SHARED, True
    return out


def hf_config(qk: bool, family: str) -> dict:
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(
        hidden_size=H, num_attention_heads=NH, num_key_value_heads=NKV, head_dim=D, num_hidden_layers=L,
        vocab_size=V, tie_word_embeddings=False, max_position_embeddings=64, rms_norm_eps=1e-6,
        num_experts_per_tok=TOPK, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )  # fmt: skip
    if family == "qwen3_moe":
        config = Qwen3MoeConfig(**common, num_experts=E, moe_intermediate_size=F, intermediate_size=64,
                                norm_topk_prob=True)  # fmt: skip
    elif family == "qwen2_moe":
        config = Qwen2MoeConfig(**common, num_experts=E, moe_intermediate_size=F, intermediate_size=64,
                                shared_expert_intermediate_size=SHARED, norm_topk_prob=False)  # fmt: skip
    else:
        config = MixtralConfig(**common, num_local_experts=E, intermediate_size=F)
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    return config.to_dict()


def _save(name: str, qk: bool, family: str, root: Path, rank: int) -> None:
    import torch

    torch.manual_seed(0)
    model = build(qk, WORLD, family, te_names=name in TE_NAMES)
    save_step(model, args(qk, family), root / name, rank)
    tokens = fixed_tokens(V)
    with torch.no_grad():
        logits = forward(model, tokens)
    write_beside(root / name, rank, hf_config(qk, family), {"tokens": tokens, "logits": logits})


def _save_tp(root: Path, rank: int) -> None:
    """``qwen3_moe_tp2``: the Qwen3-MoE model at TP=2 (experts' rows split in quarters: each
    rank's halves of gate and of up), saved as initialised (MoE with TP needs sequence
    parallelism, whose torch norms refuse the CPU: no forward here; _read_back's is the oracle)."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=WORLD, expert_model_parallel_size=1)
    model_parallel_cuda_manual_seed(123)
    torch.manual_seed(0)
    model = build(True, 1, "qwen3_moe", tp=WORLD)
    saved = args(True, "qwen3_moe")
    saved.tensor_model_parallel_size, saved.expert_model_parallel_size = WORLD, 1
    save_step(model, saved, root / "qwen3_moe_tp2", rank)
    if rank == 0:
        (root / "qwen3_moe_tp2" / "config.json").write_text(json.dumps(hf_config(True, "qwen3_moe"), indent=2))


def _read_back(rank: int, root: str, store: str) -> None:
    """megatron-core's own reader: the TP=2 save loaded into a TP=1, EP=1 model, whose forward
    is the oracle of ``qwen3_moe_tp2``."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    _cuda_stand_ins()
    _import_megatron()
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    dist.init_process_group("gloo", store=dist.FileStore(store, 1), rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel()
        model_parallel_cuda_manual_seed(123)
        model = build(True, 1, "qwen3_moe")
        step = Path(root) / "qwen3_moe_tp2" / f"iter_{ITERATION:07d}"
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(step))
        model.load_state_dict(loaded["model"])
        tokens = fixed_tokens(V)
        with torch.no_grad():
            logits = forward(model, tokens)
        torch.save({"tokens": tokens, "logits": logits}, step.parent / "oracle.pt")
    finally:
        dist.destroy_process_group()


def _worker(rank: int, root: str, store: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    _cuda_stand_ins()
    _import_megatron()
    dist.init_process_group("gloo", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD)
    try:
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=WORLD)
        model_parallel_cuda_manual_seed(123)
        for name, (qk, family) in MODELS.items():
            _save(name, qk, family, Path(root), rank)
            dist.barrier()
        _save_tp(Path(root), rank)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def make(root: Path) -> dict[str, Path]:
    import torch.multiprocessing as mp

    root.mkdir(parents=True, exist_ok=True)
    store = root / "store"
    store.unlink(missing_ok=True)
    mp.start_processes(_worker, args=(str(root), str(store)), nprocs=WORLD, start_method="spawn")
    store.unlink(missing_ok=True)
    mp.start_processes(_read_back, args=(str(root), str(store)), nprocs=1, start_method="spawn")
    store.unlink(missing_ok=True)
    return {name: root / name for name in [*MODELS, "qwen3_moe_tp2"]}


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(json.dumps({k: str(v) for k, v in make(Path(sys.argv[1])).items()}))
