"""Small NeMo Automodel EAGLE-3 drafts, and what the serving engines build, written out
here independently of streamck's tables (``streamck/plan/eagle3_layout.py``).

The draft config mirrors what nemo_automodel 0.7.0's train_eagle3 recipe writes: the
target's text config (num_hidden_layers is the target's) plus the recipe's keys.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from eagle4_drafts import serving_name  # noqa: F401  the same rename for both plans: model. dropped
from helpers import write_step

BASE_CONFIG = {
    "architectures": ["LlamaEagle3DraftModel"],
    "model_type": "llama",
    "num_hidden_layers": 32,
    "hidden_size": 16,
    "intermediate_size": 40,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 50,
    "draft_vocab_size": 50,
    "target_hidden_size": 16,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "max_position_embeddings": 2048,
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "attn_implementation": "eager",
    "fc_norm": False,
    "norm_output": False,
    "parallel_drafting": False,
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]},
    "_name_or_path": "meta-llama/Llama-3.1-8B-Instruct",
    "transformers_version": "4.57.1",
    "initializer_range": 0.02,
    "pretraining_tp": 1,
    "use_cache": True,
    "learning_rate": 3e-4,
    "ttt_steps": 7,
}


def shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Training key -> shape of an Automodel LlamaEagle3DraftModel state dict."""
    H, I, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]  # noqa: E741
    nh, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or H // nh
    T = config.get("target_hidden_size") or H
    Vd = config.get("draft_vocab_size") or V
    m = "model."
    s = {
        m + "embed_tokens.weight": (V, H),
        m + "fc.weight": (H, 3 * T),
        m + "layers.0.hidden_norm.weight": (H,),
        m + "layers.0.input_layernorm.weight": (H,),
        m + "layers.0.post_attention_layernorm.weight": (H,),
        m + "layers.0.self_attn.q_proj.weight": (nh * d, 2 * H),
        m + "layers.0.self_attn.k_proj.weight": (nkv * d, 2 * H),
        m + "layers.0.self_attn.v_proj.weight": (nkv * d, 2 * H),
        m + "layers.0.self_attn.o_proj.weight": (H, nh * d),
        m + "layers.0.mlp.gate_proj.weight": (I, H),
        m + "layers.0.mlp.up_proj.weight": (I, H),
        m + "layers.0.mlp.down_proj.weight": (H, I),
        m + "norm.weight": (H,),
        "lm_head.weight": (Vd, H),
    }
    if config.get("fc_norm"):
        s |= {f"model.fc_norm.{i}.weight": (T,) for i in range(3)}
    return s


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
    """Write a draft under ``root`` (a step dir with ``model/consolidated`` if asked), with
    d2t/t2d exactly when draft_vocab_size < vocab_size, as Automodel saves them.
    Returns (path to give the exporter, training config, training tensors)."""
    config = {**BASE_CONFIG, **(config_overrides or {})}
    config = {k: v for k, v in config.items() if v is not None}
    rng = np.random.default_rng(seed)
    tensors = {k: rng.standard_normal(s, dtype=np.float32).astype(dtype) for k, s in shapes(config).items()}
    V, Vd = config["vocab_size"], config.get("draft_vocab_size") or config["vocab_size"]
    if Vd < V:
        selected = np.sort(rng.choice(V, Vd, replace=False))
        tensors["d2t"] = (selected - np.arange(Vd)).astype(np.int64)
        t2d = np.zeros(V, dtype=np.bool_)
        t2d[selected] = True
        tensors["t2d"] = t2d
    if tensors_edit:
        tensors_edit(tensors)
    return write_step(root, config, tensors, consolidated=consolidated, shards=shards), config, tensors


# ---- what the engines build from a served config.json, and how their loaders map names ----
# vLLM 0.33 model_executor/models/llama_eagle3.py (Eagle3LlamaForCausalLM) and SGLang 0.5.23
# srt/models/llama_eagle3.py (LlamaForCausalLMEagle3), written out by hand.

STACKED = ((".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj"))
STACKED += ((".gate_proj", ".gate_up_proj"), (".up_proj", ".gate_up_proj"))


def engine_params(config: dict, engine: str) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of the module each engine builds from the served config."""
    H, I = config["hidden_size"], config["intermediate_size"]  # noqa: E741
    nh, nkv, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    V, Vd, T = config["vocab_size"], config["draft_vocab_size"], config["target_hidden_size"]
    aux = 3 if engine == "vllm" else len(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    assert config["num_hidden_layers"] == 1
    layer = "model.layers.0."
    p = {
        "model.embed_tokens.weight": (V, H),
        "model.fc.weight": (H, aux * T),
        layer + "self_attn.qkv_proj.weight": ((nh + 2 * nkv) * d, 2 * H),
        layer + "self_attn.o_proj.weight": (H, nh * d),
        layer + "mlp.gate_up_proj.weight": (2 * I, H),
        layer + "mlp.down_proj.weight": (H, I),
        layer + "input_layernorm.weight": (H,),
        layer + "post_attention_layernorm.weight": (H,),
        layer + "hidden_norm.weight": (H,),
        "model.norm.weight": (H,),
    }
    if config.get("fc_norm"):
        p |= {f"model.fc_norm.{i}.weight": (T,) for i in range(aux)}
    if config["tie_word_embeddings"] is False:
        p["lm_head.weight"] = (Vd, H)
    if engine == "vllm" and Vd < V:
        # Built at zeros whatever Vd is; zeros are the identity map when Vd = V, a wrong one otherwise.
        p["draft_id_to_target_id"] = (Vd,)
    return p


def engine_load(name: str, engine: str) -> str | None:
    """The parameter a checkpoint key lands in (None: consumed outside the parameters)."""
    if engine == "vllm":
        if name == "t2d":
            return None
        if name == "d2t":
            return "draft_id_to_target_id"
        name = name if name.startswith("lm_head") else "model." + name
    else:
        if name in ("d2t", "t2d"):  # d2t becomes hot_token_id; t2d is skipped
            return None
        name = name if name.startswith("lm_head") else "model." + name
    for shard, fused in STACKED:
        if shard in name:
            return name.replace(shard, fused)
    return name


def engine_shape(keys: dict[str, tuple[int, ...]], param: str) -> tuple[int, ...]:
    """The shape a fused parameter gets from the checkpoint shards that load into it."""
    parts = [s for k, s in keys.items() if k not in ("d2t", "t2d") and engine_load(k, "sglang") == param]
    if param == "draft_id_to_target_id":
        parts = [keys["d2t"]]
    return (sum(s[0] for s in parts), *parts[0][1:])
