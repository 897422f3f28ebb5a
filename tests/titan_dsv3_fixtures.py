"""DeepSeek-V3 steps written by torchtitan 0.3.0's own CheckpointManager, on CPU/gloo, 2 ranks.

``python tests/titan_dsv3_fixtures.py ROOT`` builds torchtitan's DeepSeek-V3 with its own layer
builder (``build_mla_moe_layers``: MLA attention, the first layer dense, the others MoE with a
shared expert and load balancing on, sigmoid routing renormalised and scaled as DeepSeek-V3's),
trains it one optimizer step and saves with ``CheckpointManager.save`` into
``ROOT/<case>/checkpoint/step-1/`` (the driver, patches and stateful stand-ins are
tests/titan_moe_fixtures.py's). Cases:

* ``deepseek_v3``: queries through the low-rank ``wq_a`` / ``q_norm`` / ``wq_b``, FSDP 2; a
  forward pass counts tokens per expert and torchtitan's ``register_moe_load_balancing_hook``
  moves ``expert_bias_E`` at the step, as in training (nonzero: Hugging Face's
  ``e_score_correction_bias``);
* ``deepseek_v3_ep2``: queries through ``wq`` (``q_lora_rank=0``), expert parallel EP=2 through
  torchtitan's own ``parallelize_deepseekv3``, one MTP layer (``num_mtp_layers=1``).

Beside each: ``config.json`` (the Hugging Face DeepseekV3 config a user would write),
``to_hf.safetensors`` (torchtitan's convert_to_hf route: ``dcp.load`` into the model's state dict,
then ``DeepSeekV3StateDictAdapter.to_hf``), and ``logits.pt``: torchtitan's own forward of the
saved model on ``TOKENS`` with its experts in fp32 (torchtitan always runs them through bf16
``torch._grouped_mm``; the oracle swaps in an fp32 loop over the same experts and token groups).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from titan_moe_fixtures import WORLD, _normal, expert_parallel, import_torchtitan, load_balancing, train_and_save

# dim, n_heads, kv_lora_rank, qk_nope, qk_rope, v_head, dense_hidden, moe_hidden, experts, shared, top_k,
# layers, dense layers, vocab
DIMS = (64, 4, 32, 16, 8, 16, 96, 32, 4, 1, 2, 3, 1, 128)
ROUTE_SCALE = 2.5
# case -> (q_lora_rank, load-balancing bias updated, expert parallel, MTP layers)
CASES = {"deepseek_v3": (16, True, False, 0), "deepseek_v3_ep2": (0, False, True, 1)}
SEQ = 12
TOKENS_SEED = 7


def tokens():
    import torch

    return torch.randint(0, DIMS[-1], (2, SEQ), generator=torch.Generator().manual_seed(TOKENS_SEED))


def model_config(q_lora_rank: int, mtp: int):
    """torchtitan's DeepSeek-V3 config for DIMS, built by torchtitan's own builders."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model, _build_dsv3_layers, _build_mtp_layers

    dim, nh, kv, nope, rope_d, vh, dense, moe, experts, shared, top_k, layers, n_dense, vocab = DIMS
    blocks = _build_dsv3_layers(
        n_layers=layers, n_dense_layers=n_dense, dim=dim, n_heads=nh, q_lora_rank=q_lora_rank, kv_lora_rank=kv,
        qk_nope_head_dim=nope, qk_rope_head_dim=rope_d, v_head_dim=vh, mscale=1.0, dense_hidden_dim=dense,
        moe_hidden_dim=moe, num_experts=experts, num_shared_experts=shared, router_top_k=top_k,
        router_score_func="sigmoid", router_route_scale=ROUTE_SCALE, router_route_norm=True, attn_backend="flex",
        moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=rope_d, max_seq_len=64, theta=10000.0),
    )  # fmt: skip
    return DeepSeekV3Model.Config(
        vocab_size=vocab,
        dim=dim,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init={"weight": _normal}),
        norm=RMSNorm.Config(normalized_shape=dim, param_init={"weight": _normal}),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init={"weight": _normal}),
        layers=blocks,
        mtp_layers=_build_mtp_layers(blocks[-1], dim=dim, num_mtp_layers=mtp),
    )


def hf_config(q_lora_rank: int, mtp: int) -> dict:
    from transformers import DeepseekV3Config

    dim, nh, kv, nope, rope_d, vh, dense, moe, experts, shared, top_k, layers, n_dense, vocab = DIMS
    config = DeepseekV3Config(
        hidden_size=dim, num_attention_heads=nh, num_key_value_heads=nh, q_lora_rank=q_lora_rank or None,
        kv_lora_rank=kv, qk_nope_head_dim=nope, qk_rope_head_dim=rope_d, v_head_dim=vh, intermediate_size=dense,
        moe_intermediate_size=moe, n_routed_experts=experts, n_shared_experts=shared, num_experts_per_tok=top_k,
        n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=ROUTE_SCALE, num_hidden_layers=layers,
        first_k_dense_replace=n_dense, vocab_size=vocab, tie_word_embeddings=False, max_position_embeddings=64,
        rms_norm_eps=1e-5, rope_interleave=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        num_nextn_predict_layers=mtp,
    )  # fmt: skip
    config.architectures = ["DeepseekV3ForCausalLM"]
    return config.to_dict()


def _save_one(name: str, case: tuple, root: Path, rank: int) -> None:
    import torch

    q_lora_rank, biased, ep, mtp = case
    out = root / name
    torch.manual_seed(0)
    config = model_config(q_lora_rank, mtp)
    if ep:  # what the trainer's update_from_config does for expert_parallel_degree > 1
        from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config

        set_deepseek_v3_sharding_config(config, enable_sp=False, enable_ep=True)
    model = config.build()
    model.init_weights(buffer_device=None)
    train_and_save(
        model, out, rank, (lambda m: _expert_parallel(m, root)) if ep else None, _load_balancing if biased else None
    )
    if rank == 0:
        (out / "config.json").write_text(json.dumps(hf_config(q_lora_rank, mtp), indent=2))


def _expert_parallel(model, root: Path) -> None:
    """torchtitan's own parallelize_deepseekv3 with EP = FSDP = 2 on the 2 ranks (FSDP applied
    as tests/titan_moe_fixtures.py's EP case: partial_dtensor, fp32 parameters)."""
    from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseekv3

    expert_parallel(model, root, parallelize_deepseekv3)


def _load_balancing(model, optimizers) -> None:
    """torchtitan's own load-balancing hook, after a forward pass counted each expert's tokens."""
    load_balancing(model, optimizers, tokens())


def _fp32_experts(self, x_RD, num_tokens_per_expert_E):
    """GroupedExperts.forward with each expert's tokens through fp32 matmuls, in its groups."""
    import torch
    import torch.nn.functional as F

    out, start = [], 0
    for e, count in enumerate(num_tokens_per_expert_E.tolist()):
        x = x_RD[start : start + int(count)]
        h = F.silu(x @ self.w1_EFD[e].T) * (x @ self.w3_EFD[e].T)
        out.append(h @ self.w2_EDF[e].T)
        start += int(count)
    return torch.cat([*out, x_RD[start:] * 0]).type_as(x_RD)


def convert_to_hf(case: tuple, step: Path, out_dir: Path) -> None:
    """torchtitan's convert_to_hf route (dcp.load into the model's state dict, then to_hf), and
    the saved model's own logits with fp32 experts."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torchtitan.components.checkpointer import ModelWrapper
    from torchtitan.models.common.moe import GroupedExperts
    from torchtitan.models.deepseek_v3 import DeepSeekV3StateDictAdapter

    q_lora_rank, _, _, mtp = case
    config = model_config(q_lora_rank, mtp)
    with torch.device("cpu"):
        model = config.build()
    state = ModelWrapper(model)._get_state_dict()
    dcp.load(state, checkpoint_id=str(step))
    hf = DeepSeekV3StateDictAdapter(config, None).to_hf(state)
    save_file({k: v.contiguous() for k, v in hf.items()}, str(out_dir / "to_hf.safetensors"))
    model.load_state_dict(state)
    GroupedExperts.forward = _fp32_experts
    positions = torch.arange(SEQ).repeat(2, 1)
    with torch.no_grad():
        logits = model(tokens(), positions, model.get_attention_masks(positions=positions))
    torch.save(logits if isinstance(logits, torch.Tensor) else logits[0], out_dir / "logits.pt")


def _worker(rank: int, root: str, store: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    import_torchtitan()
    with_dsv3()
    dist.init_process_group("gloo", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD)
    try:
        for name, case in CASES.items():
            _save_one(name, case, Path(root), rank)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def with_dsv3() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from standins import without_triton

    with without_triton():
        import torchtitan.models.deepseek_v3  # noqa: F401


def make(root: Path) -> dict[str, Path]:
    import torch.multiprocessing as mp

    root.mkdir(parents=True, exist_ok=True)
    store = root / "store"
    store.unlink(missing_ok=True)
    mp.start_processes(_worker, args=(str(root), str(store)), nprocs=WORLD, start_method="spawn")
    store.unlink(missing_ok=True)
    import_torchtitan()
    with_dsv3()
    for name, case in CASES.items():
        convert_to_hf(case, root / name / "checkpoint" / "step-1", root / name)
    return {name: root / name for name in CASES}


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(json.dumps({k: str(v) for k, v in make(Path(sys.argv[1])).items()}))
