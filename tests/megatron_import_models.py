"""The Hugging Face models the Megatron import tests start from (transformers' own classes, seeded,
fp32), and the Megatron-LM flags of each: what a user passes to ``pretrain_gpt.py`` for that model.

MODELS: name -> (transformers config class name, its keyword arguments). Every model has 4 layers
(pipeline parallel 2 splits them) and 4 attention heads; most have 2 query groups (tensor parallel 2
splits them) and a 250-token vocabulary, which Megatron pads to 256; llama_mha has a group per head
(MHA), llama_mqa one group (MQA, Megatron replicates it over TP) and 257 tokens (384 padded rows
written, 512 at TP=2); the MoE models 4 experts (expert parallel 2 splits them).
RUNS: every run root the tests write, the models as they are and VARIANTS (other streamck flags).
"""

from __future__ import annotations

from pathlib import Path

SMALL = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
             vocab_size=250, rms_norm_eps=1e-6, max_position_embeddings=64)  # fmt: skip
MODELS = {
    "llama": ("LlamaConfig", {**SMALL, "head_dim": 16, "rope_theta": 500000.0, "tie_word_embeddings": False}),
    "llama_tied": ("LlamaConfig", {**SMALL, "head_dim": 16, "rope_theta": 10000.0, "tie_word_embeddings": True}),
    "llama_mha": (
        "LlamaConfig",
        {**SMALL, "num_key_value_heads": 4, "head_dim": 16, "rope_theta": 10000.0, "tie_word_embeddings": False},
    ),
    "llama_mqa": (
        "LlamaConfig",
        {
            **SMALL,
            "num_key_value_heads": 1,
            "vocab_size": 257,
            "head_dim": 16,
            "rope_theta": 500000.0,
            "tie_word_embeddings": False,
        },
    ),
    "qwen3": ("Qwen3Config", {**SMALL, "head_dim": 32, "rope_theta": 1000000.0, "tie_word_embeddings": False}),
    "qwen2": ("Qwen2Config", {**SMALL, "rope_theta": 1000000.0, "tie_word_embeddings": False}),
    "mixtral": (
        "MixtralConfig",
        {
            **SMALL,
            "head_dim": 16,
            "rope_theta": 1000000.0,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "tie_word_embeddings": False,
        },
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {
            **SMALL,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": False,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "norm_topk_prob": False,
        },
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            **SMALL,
            "head_dim": 16,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": False,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        },
    ),
}
# MoE flags of Megatron-LM beside the model's: the CPU needs the allgather dispatcher (alltoall makes a
# CUDA stream); no load balancing loss (a forward's logits are compared).
MOE_CPU = "--moe-token-dispatcher-type allgather --moe-router-load-balancing-type none".split()
# (TP, PP, EP) each model is loaded at: a dense one at DENSE, an MoE model at EP=2 (beside PP=2) too.
DENSE = ((1, 1, 1), (2, 2, 1))
LAYOUTS = {"qwen3_moe": ((1, 1, 1), (1, 2, 2)), "mixtral": ((1, 2, 2),), "qwen2_moe": ((1, 2, 2),)}
# name -> (model, streamck's flags beside --format megatron, layouts): runs of a model written otherwise.
# llama_div100: 300 padded rows written, 256 at Megatron's TP=2 (its default divisor, 128): the
# embedding's and the head's allow_shape_mismatch load. llama_bf16: BF16 chunks into Megatron's fp32 model.
VARIANTS = {
    "llama_div100": ("llama", ("--make-vocab-size-divisible-by", "100"), ((2, 2, 1),)),
    "llama_bf16": ("llama", ("--dtype", "bf16"), ((2, 2, 1),)),
}
RUNS = {**{n: (n, (), LAYOUTS.get(n, DENSE)) for n in MODELS}, **VARIANTS}
MEGATRON_DIVISOR = 128  # Megatron-LM's --make-vocab-size-divisible-by default, which flags() leaves as it is


def padded(vocab: int, tp: int) -> int:
    """The vocabulary Megatron-LM's model has at TP=tp (its own rule: a multiple of divisor x TP)."""
    multiple = MEGATRON_DIVISOR * tp
    return -(-vocab // multiple) * multiple


def build(name: str, folder: Path) -> None:
    """MODELS[name] with seeded random weights, saved by ``save_pretrained`` (safetensors)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    kind, kwargs = MODELS[name]
    torch.manual_seed(sum(map(ord, name)))
    model = AutoModelForCausalLM.from_config(getattr(transformers, kind)(**kwargs), dtype=torch.float32)
    with torch.no_grad():  # norms away from 1, so that a norm loaded in the wrong place shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder)


def logits(folder: Path, tokens, bf16: bool = False):
    """transformers' fp32 forward of the saved model on ``tokens``; with ``bf16``, of its weights
    rounded to BF16 by torch (``.to(torch.bfloat16)``) first, the forward still fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters() if bf16 else ():
            p.copy_(p.to(torch.bfloat16))
        return model(input_ids=tokens).logits


def flags(name: str) -> list[str]:
    """Megatron-LM's flags for MODELS[name] (beside bench/megatron_loop.py's COMMON)."""
    _, c = MODELS[name]
    pairs = {"--num-layers": "num_hidden_layers", "--hidden-size": "hidden_size",
             "--ffn-hidden-size": "intermediate_size", "--num-attention-heads": "num_attention_heads",
             "--num-query-groups": "num_key_value_heads", "--kv-channels": "head_dim", "--vocab-size": "vocab_size",
             "--norm-epsilon": "rms_norm_eps"}  # fmt: skip
    c = {"head_dim": c["hidden_size"] // c["num_attention_heads"], **c}
    out = [str(v) for flag, key in pairs.items() for v in (flag, c[key])]
    out += ["--group-query-attention", "--rotary-base", str(int(c["rope_theta"]))]
    if not c["tie_word_embeddings"]:
        out.append("--untie-embeddings-and-output-weights")
    if name.startswith("qwen3"):
        out.append("--qk-layernorm")
    if name.startswith("qwen2"):
        out.append("--add-qkv-bias")
    experts = c.get("num_experts") or c.get("num_local_experts")
    if experts:
        size = c.get("moe_intermediate_size") or c["intermediate_size"]  # Mixtral's experts are its MLP
        out += ["--num-experts", str(experts), "--moe-ffn-hidden-size", str(size),
                "--moe-router-topk", str(c["num_experts_per_tok"]), *MOE_CPU]  # fmt: skip
    if c.get("shared_expert_intermediate_size"):  # Qwen2-MoE: a gated shared expert, softmax over every expert
        out += ["--moe-shared-expert-intermediate-size", str(c["shared_expert_intermediate_size"]),
                "--moe-shared-expert-gate", "--moe-router-pre-softmax"]  # fmt: skip
    return out
