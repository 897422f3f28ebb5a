"""Small EAGLE-4 drafts in the training layout, built from the contract's table."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from helpers import write_step

BASE_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_hidden_layers": 32,
    "hidden_size": 16,
    "intermediate_size": 40,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 50,
    "rms_norm_eps": 1e-5,
    "efficient_lm_head_rank": 6,
    "rope_theta": 500000.0,
    "max_position_embeddings": 2048,
    "hidden_act": "silu",
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]},
    "_name_or_path": "meta-llama/Llama-3.1-8B",
    "transformers_version": "4.55.0",
    "learning_rate": 3e-4,
    "ttt_length": 7,
}


def shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Training key -> shape, written out independently of streamck's table."""
    H, I, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]  # noqa: E741
    nh, nkv, R = config["num_attention_heads"], config["num_key_value_heads"], config["efficient_lm_head_rank"]
    d = config.get("head_dim") or H // nh
    T = config.get("target_hidden_size") or H
    A = len(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    p = "model.layers.0."
    s = {
        "model.fc.weight": (H, A * T),
        p + "hidden_norm.weight": (H,),
        p + "input_layernorm.weight": (H,),
        p + "post_attention_layernorm.weight": (H,),
        p + "self_attn.q_proj.weight": (nh * d, 2 * H),
        p + "self_attn.k_proj.weight": (nkv * d, 2 * H),
        p + "self_attn.v_proj.weight": (nkv * d, 2 * H),
        p + "self_attn.o_proj.weight": (H, nh * d),
        p + "mlp.gate_proj.weight": (I, H),
        p + "mlp.up_proj.weight": (I, H),
        p + "mlp.down_proj.weight": (H, I),
        "model.norm.weight": (H,),
        "model.embed_tokens.weight": (V, H),
        "lm_head.weight": (V, H),
        "efficient_lm_head_down_proj.weight": (R, H),
        "efficient_lm_head.weight": (V, R),
    }
    if config.get("attention_bias"):
        s |= {
            p + "self_attn.q_proj.bias": (nh * d,),
            p + "self_attn.k_proj.bias": (nkv * d,),
            p + "self_attn.v_proj.bias": (nkv * d,),
            p + "self_attn.o_proj.bias": (H,),
        }
    if config.get("mlp_bias"):
        s |= {p + "mlp.gate_proj.bias": (I,), p + "mlp.up_proj.bias": (I,), p + "mlp.down_proj.bias": (H,)}
    return s


def serving_name(train: str) -> str:
    return train.removeprefix("model.")


def make_draft(
    root: Path,
    config_overrides: dict | None = None,
    *,
    consolidated: bool = False,
    shards: int = 0,
    dtype=np.float32,
    tensors_edit=None,
    seed: int = 0,
) -> tuple[Path, dict, dict[str, np.ndarray]]:
    """Write a draft under ``root`` (a step dir with ``model/consolidated`` if asked).
    Returns (path to give the exporter, training config, training tensors)."""
    config = {**BASE_CONFIG, **(config_overrides or {})}
    config = {k: v for k, v in config.items() if v is not None}
    rng = np.random.default_rng(seed)
    tensors = {k: rng.standard_normal(s, dtype=np.float32).astype(dtype) for k, s in shapes(config).items()}
    if tensors_edit:
        tensors_edit(tensors)
    return write_step(root, config, tensors, consolidated=consolidated, shards=shards), config, tensors
