"""The gpt-oss MLX tests' sources and mlx_lm.convert's folders for them (tests/test_mlx_gptoss.py),
built once per machine in the fixture cache, keyed by this file and the producers it runs.

- ``bf16``: transformers' tiny ``GptOssForCausalLM`` (every weight, bias and sink perturbed, so that
  gate and up differ in each expert) by ``save_pretrained``: ``experts.gate_up_proj`` [E, H, 2I]
  (gate and up columns interleaved), ``down_proj`` [E, I, H], their biases.
- ``mxfp4``: the published MXFP4 layout, tests/dequant_oracles.py's ``gptoss`` (transformers'
  model with seeded MXFP4 expert blocks and scales, the Hub's quantization_config).

Both get the tests' byte-level tokenizer (tests/mlx_models.py) and the Hub's gpt-oss ``rope_theta``
and ``rope_scaling`` (yarn) beside transformers 5's ``rope_parameters``: mlx-lm 0.32.2 reads the
former only (without them it would run a plain RoPE, not the model's).

The references are mlx_lm.convert's. It converts the MXFP4 folder as it is. transformers' own bf16
layout it refuses ("parameters not in model": its sanitize splits the rows of an [E, 2I, H]
``gate_up_proj.weight``), so its reference is converted from ``bf16-mlx-layout``: the same
tensors with each expert weight transposed to [E, out, in] under a ``.weight`` name, the layout
that sanitize splits (the de-interleaving is mlx-lm's; the transposition is checked by the
logits' closeness to transformers').
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from fixture_cache import built_once, fixture_root

HERE = Path(__file__).parent
CODE = ("tests/mlx_gptoss_models.py", "tests/mlx_models.py", "tests/dequant_oracles.py", "tests/quant_fixtures.py",
        "tests/mlx_env.py", "tests/mlx_driver.py")  # fmt: skip
VOCAB = 320  # the tokenizer's 258 tokens and spare rows (the MXFP4 model's is 256: BOS and EOS past it)
CONFIG = dict(hidden_size=128, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, num_local_experts=4, num_experts_per_tok=2, vocab_size=VOCAB,
              layer_types=["sliding_attention", "full_attention"], sliding_window=16, bos_token_id=256,
              eos_token_id=257, pad_token_id=None)  # fmt: skip
# openai/gpt-oss-20b's config.json spells its RoPE so (transformers 5 saves rope_parameters instead)
HUB_ROPE = {"rope_theta": 150000.0, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
            "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False}}  # fmt: skip
SHARD = 96 << 10  # cuts the Q8 model into several shards, some between a module's weight and its scales
# mlx_lm.convert's folders: name -> (source, convert()'s arguments)
REFERENCES = {
    "bf16": ("bf16-mlx-layout", {}),
    "bf16-f32": ("bf16-mlx-layout", {"dtype": "float32"}),
    "bf16-q4": ("bf16-mlx-layout", {"quantize": True}),
    "bf16-mxfp4": ("bf16-mlx-layout", {"quantize": True, "q_mode": "mxfp4"}),
    "bf16-q8-shards": ("bf16-mlx-layout", {"quantize": True, "q_bits": 8, "shard_bytes": SHARD}),
    "mxfp4": ("mxfp4", {}),
    "mxfp4-f32": ("mxfp4", {"dtype": "float32"}),
    "mxfp4-q4": ("mxfp4", {"quantize": True}),
    "mxfp4-mxfp4": ("mxfp4", {"quantize": True, "q_mode": "mxfp4"}),
}


def gptoss_world(tmp_path_factory) -> Path:
    """The folder of the sources (``bf16``, ``bf16-mlx-layout``, ``mxfp4``) and of every
    REFERENCES folder under ``refs/``, built once per machine (one mlx child for the references)."""
    root = fixture_root(tmp_path_factory, "mlx-gptoss", *CODE)
    return built_once(root / "world", _build)


def _build(tmp: Path) -> None:
    from mlx_env import run_jobs
    from quant_fixtures import run_driver

    _bf16(tmp / "bf16")
    _mlx_layout(tmp / "bf16", tmp / "bf16-mlx-layout")
    run_driver(HERE / "dequant_oracles.py", "gptoss", tmp / "mxfp4")
    _finish(tmp / "mxfp4")
    jobs = [
        {"op": "convert", "src": str(tmp / src), "dst": str(tmp / "refs" / name), **convert}
        for name, (src, convert) in REFERENCES.items()
    ]
    (tmp / "refs").mkdir()
    errors = [a["error"] for a in run_jobs(jobs) if "error" in a]
    assert not errors, errors


def _bf16(out: Path) -> None:
    """transformers' tiny gpt-oss in bf16, every parameter perturbed (its biases and sinks start at zero)."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(3)
    model = GptOssForCausalLM(GptOssConfig(**CONFIG)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.to(torch.bfloat16).save_pretrained(out)
    _finish(out)


def _finish(folder: Path) -> None:
    """The tokenizer and the Hub's RoPE keys, beside a producer's save."""
    from mlx_models import make_tokenizer

    make_tokenizer(folder)
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **HUB_ROPE}, indent=2, sort_keys=True) + "\n")


def _mlx_layout(src: Path, out: Path) -> None:
    """``src`` with ``experts.gate_up_proj`` and ``down_proj`` as ``<name>.weight`` [E, out, in] (the
    layout mlx-lm's sanitize reads), everything else as it is."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    tensors = load_file(src / "model.safetensors")
    fused = [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(fused) == 2 * CONFIG["num_hidden_layers"], fused
    for k in fused:
        tensors[f"{k}.weight"] = tensors.pop(k).transpose(-1, -2).contiguous()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
