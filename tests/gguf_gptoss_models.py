"""The gpt-oss GGUF tests' models, kept in the fixture cache keyed by this file: a tiny
``GptOssForCausalLM`` in the two layouts a gpt-oss folder comes in.

- ``bf16``: what a fine-tuner's ``save_pretrained`` writes, fused experts ``mlp.experts.gate_up_proj``
  [E, H, 2I] (gate and up columns interleaved) and ``down_proj`` [E, I, H], random bf16 weights.
- ``mxfp4``: the published layout (openai/gpt-oss-20b's names, shapes and ``quantization_config``):
  the same model with its experts replaced by seeded MXFP4 blocks and E8M0 scales
  (``gate_up_proj_blocks`` U8 [E, 2I, H/32, 16], ``_scales`` [E, 2I, H/32]; ``down_proj_blocks``
  [E, H, I/32, 16], ``_scales`` [E, H, I/32]), as tests/dequant_oracles.py's ``gptoss`` builds them,
  since no MXFP4 producer runs on a CPU. Every byte value occurs in the blocks; the exponents are
  2^-5 and 2^-4, so the experts' values have about the bf16 weights' spread and the tiny network
  stays in a range where llama.cpp's and transformers' arithmetic agree.

Both carry the tests' llama-bpe tokenizer (bench/gguf_ckpt.py's ``make_tokenizer``, from the
vocabulary llama.cpp ships for its tokenizer tests): gpt-oss's own o200k vocabulary is another
BPE vocabulary read the same way, and its size would only slow the tests.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from fixture_cache import built_once, fixture_root
from gguf_models import gguf_ckpt, llama_cpp

CONFIG = dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=128256, hidden_size=64,
              intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
              num_local_experts=4, num_experts_per_tok=2, sliding_window=16, max_position_embeddings=4096,
              layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False,
              bos_token_id=128000, eos_token_id=128001)  # fmt: skip
# openai/gpt-oss-20b's quantization_config (its modules_to_not_convert under this model's names)
QUANT = {"quant_method": "mxfp4",
         "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                    "lm_head"]}  # fmt: skip
EXPONENTS = (127 - 5, 127 - 3)  # E8M0 scales drawn from [lo, hi): 2^-5 and 2^-4


def _root(tmp_path_factory) -> Path:
    return fixture_root(tmp_path_factory, "gguf-gptoss", "tests/gguf_gptoss_models.py", "bench/gguf_ckpt.py")


def bf16_model(tmp_path_factory) -> Path:
    """The bf16 layout's folder (named ``model``: the folder's name is ``general.name``), built once."""
    return built_once(_root(tmp_path_factory) / "bf16" / "model", make_bf16)


def mxfp4_model(tmp_path_factory) -> Path:
    """The MXFP4 layout's folder (named ``model``), built once from the bf16 one."""
    bf16 = bf16_model(tmp_path_factory)
    return built_once(_root(tmp_path_factory) / "mxfp4" / "model", lambda tmp: make_mxfp4(bf16, tmp))


def make_bf16(out: Path, seed: int = 0) -> None:
    """The bf16 model in ``out``: matrices of std 0.15, 1-D tensors (norms, biases, sinks) in
    [0.5, 1.5), as bench/gguf_ckpt.py's models, and the llama-bpe tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**CONFIG), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.15) if p.ndim > 1 and not name.endswith("_bias") else p.uniform_(0.5, 1.5)
    model.to(torch.bfloat16).save_pretrained(out)
    cpp = llama_cpp()
    gguf_ckpt.make_tokenizer(cpp / "models" / "ggml-vocab-llama-bpe.gguf", "llama-bpe", out, cpp / "gguf-py")


def mxfp4_experts(seed: int, experts: int, rows: int, cols: int):
    """Blocks [E, rows, cols/32, 16] (every byte value at least once) and E8M0 scales
    [E, rows, cols/32] for a weight stored [E, rows, cols], from a seeded generator."""
    import torch

    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
    blocks.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    scales = torch.randint(*EXPONENTS, (experts, rows, cols // 32), generator=g, dtype=torch.uint8)
    return blocks, scales


def make_mxfp4(bf16: Path, out: Path) -> None:
    """``bf16``'s model in the published layout in ``out``: each layer's fused experts replaced by
    MXFP4 blocks and scales, ``quantization_config`` added, the tokenizer copied."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(bf16 / "model.safetensors")
    e, h, i = CONFIG["num_local_experts"], CONFIG["hidden_size"], CONFIG["intermediate_size"]
    for layer in range(CONFIG["num_hidden_layers"]):
        pre = f"model.layers.{layer}.mlp.experts."
        assert tensors.pop(pre + "gate_up_proj").shape == (e, h, 2 * i)
        assert tensors.pop(pre + "down_proj").shape == (e, i, h)
        tensors[pre + "gate_up_proj_blocks"], tensors[pre + "gate_up_proj_scales"] = mxfp4_experts(
            2 * layer, e, 2 * i, h
        )
        tensors[pre + "down_proj_blocks"], tensors[pre + "down_proj_scales"] = mxfp4_experts(2 * layer + 1, e, h, i)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((bf16 / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": QUANT}, indent=2))
    for f in bf16.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, out / f.name)
