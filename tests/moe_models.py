"""Tiny transformers MoE models of each family in FAMILIES, built from a config, for the MoE tests.

``tiny_config(model_type)`` is a config of 2 layers, 4 experts and hidden size 16 whose sizes
make every per-expert slice distinct (gate/up rows [I, H] with I != H); ``logits`` runs a model
on fixed tokens.
"""

from __future__ import annotations

VOCAB = 64
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
_MLA = dict(num_key_value_heads=2, head_dim=4, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4)
_MLA["v_head_dim"] = 4
# model_type -> the config fields that make it an MoE of 4 experts (first_k_dense_replace=1: one dense layer).
_SHARED = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=12)
SPECS = {
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8),
    "qwen2_moe": _SHARED,
    "qwen3_next": _SHARED,
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "minimax": dict(num_local_experts=4, num_experts_per_tok=2),
    "phimoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "deepseek_v3": dict(
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        **_MLA,
    ),
    "deepseek_v2": dict(
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
        n_shared_experts=1,
        first_k_dense_replace=1,
        **_MLA,
    ),
    "glm4_moe": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, first_k_dense_replace=1),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "hunyuan_v1_moe": dict(num_experts=4, moe_topk=2),
    "ernie4_5_moe": dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=8),
    "jamba": dict(num_experts=4, num_experts_per_tok=2),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2),
    "llama4_text": dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=24),
}


def tiny_config(model_type: str, **extra):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**COMMON, **SPECS[model_type], **extra})


def tiny_model(model_type: str, seed: int = 0):
    """A randomly initialised causal LM of ``model_type`` (fp32), every parameter perturbed so
    that no two experts (nor any zero-initialised bias) are alike."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type)).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def logits(model):
    import torch

    ids = (torch.arange(24).reshape(2, 12) * 7 + 3) % VOCAB
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits
