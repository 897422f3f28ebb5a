"""Bases and adapters written by transformers' and PEFT's own save_pretrained, and the oracle:
PEFT's merge_and_unload of the same adapter, saved by save_pretrained."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=64,
)


def make_base(
    root: Path, *, tied: bool = False, shard: str | None = None, seed: int = 0, gpt2: bool = False, **config
) -> Path:
    """A tiny bf16 LlamaForCausalLM saved by save_pretrained (sharded with ``shard``, e.g. "40KB");
    with ``gpt2`` a GPT-2 instead (Conv1D layers, stored (in, out): PEFT's fan_in_fan_out)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if gpt2:
        cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64, tie_word_embeddings=tied)
        model = GPT2LMHeadModel(cfg).to(torch.bfloat16)
    else:
        model = LlamaForCausalLM(LlamaConfig(**{**TINY, **config}, tie_word_embeddings=tied)).to(torch.bfloat16)
    with torch.no_grad():  # norms start at 1: give them values a mix-up would show
        for name, p in model.named_parameters():
            if "norm" in name or ".ln_" in name:
                p.uniform_(0.5, 1.5)
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(root, **kw)
    return root


def load_base(base: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)


def make_adapter(
    base: Path, out: Path, *, seed: int = 1, adapter_name: str = "default", autocast: bool = True, prepare=None, **lora
) -> Path:
    """An adapter trained by nobody: PEFT's get_peft_model on ``base``, every LoRA weight set
    random (B starts at zero), saved by PEFT's save_pretrained. ``autocast=False`` keeps the
    adapter in the base's bf16; ``prepare(model)`` changes the base first (a resized
    vocabulary). Returns the adapter folder."""
    from peft import LoraConfig, get_peft_model

    model = load_base(base)
    if prepare is not None:
        prepare(model)
    config = LoraConfig(**{"r": 8, "lora_alpha": 16, "target_modules": "all-linear", **lora})
    peft_model = get_peft_model(model, config, adapter_name=adapter_name, autocast_adapter_dtype=autocast)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                p.copy_(torch.randn_like(p) * (0.02 if "magnitude" not in name else 1.0) + ("magnitude" in name))
    peft_model.save_pretrained(out)
    return out / adapter_name if adapter_name != "default" else out


def peft_merge(base: Path, adapter: Path, out: Path, *, safe_merge: bool = False) -> Path:
    """The oracle: PeftModel.from_pretrained, merge_and_unload, save_pretrained."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(load_base(base), adapter)
    merged = model.merge_and_unload(safe_merge=safe_merge)
    merged.save_pretrained(out)
    return out


def config_of(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


# name: (base options, adapter options, oracle options). Every base is written sharded too
# where "shard" says so; every adapter is PEFT's own save_pretrained output.
CASES = {
    "plain": ({"shard": "40KB"}, {}, {}),
    "rslora_patterns": (
        {},
        {
            "use_rslora": True,
            "rank_pattern": {"q_proj": 16, "layers.1.mlp.down_proj": 4},
            "alpha_pattern": {"v_proj": 7, r"layers\.0\..*": 3},
        },
        {},
    ),
    "dora": ({}, {"use_dora": True}, {}),
    "embedding_and_saved_head": (
        {},
        {"target_modules": ["q_proj", "embed_tokens"], "modules_to_save": ["lm_head"]},
        {},
    ),
    "tied_embedding": ({"tied": True}, {"target_modules": ["embed_tokens", "v_proj"]}, {}),
    "tied_saved_embedding": ({"tied": True}, {"target_modules": ["q_proj"], "modules_to_save": ["embed_tokens"]}, {}),
    "tied_saved_head": ({"tied": True}, {"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}, {}),
    "lora_bias": ({"attention_bias": True}, {"target_modules": ["q_proj", "k_proj", "v_proj"], "lora_bias": True}, {}),
    "bf16_adapter": ({}, {"autocast": False}, {}),
    "safe_merge": ({}, {}, {"safe_merge": True}),
    "named_adapter": ({}, {"adapter_name": "mine", "r": 4}, {}),
    "gpt2_fan_in_fan_out": (
        {"gpt2": True, "tied": True},
        {"target_modules": ["c_attn", "c_proj", "c_fc"], "fan_in_fan_out": True, "lora_bias": True},
        {},
    ),
}


def build_case(root: Path, name: str, cache: dict) -> dict:
    """Base, adapter and PEFT's merge for CASES[name] under ``root``, made once per ``cache``."""
    if name in cache:
        return cache[name]
    base_kw, lora_kw, oracle_kw = CASES[name]
    case_dir = root / name
    base = make_base(case_dir / "base", **base_kw)
    adapter = make_adapter(base, case_dir / "adapter", **lora_kw)
    oracle = peft_merge(base, adapter, case_dir / "peft", **oracle_kw)
    cache[name] = {"base": base, "adapter": adapter, "oracle": oracle, **oracle_kw}
    return cache[name]
