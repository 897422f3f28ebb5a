"""``--quantize`` and ``--dtype`` dequantization with ``--device cuda``: the same operations on the
same dtypes as on the CPU (whose bits tests/test_quantize.py and test_dequantize*.py hold to
llm-compressor's and transformers' own), so the output must be byte for byte the CPU run's. The
GPU tests run where torch sees a device (scripts/gpu-check); the refusal runs everywhere else."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import cli

torch = pytest.importorskip("torch")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SCHEMES = ("FP8_DYNAMIC", "FP8_BLOCK", "NVFP4A16", "MXFP4A16")


def _model(root: Path) -> Path:
    """A bf16 Llama-shaped folder whose weights hit the schemes' edges: widths that are no
    multiple of 128, an all-zero tile, values past FP8's range, q/k/v and gate/up sharing NVFP4
    global scales across two files."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(3)
    h, i = 192, 320

    def w(rows: int, cols: int, scale: float = 1.0):
        return (torch.randn(rows, cols, generator=g) * scale).to(torch.bfloat16)

    q = w(h, h)
    q[:128, :128] = 0  # a zero tile: FP8 eps scale, NVFP4 0.125, MX exponent floor
    k = w(64, h, 1e3)  # past ±448 before scaling
    first = {
        "model.embed_tokens.weight": w(256, h),
        "model.layers.0.input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": q,
        "model.layers.0.self_attn.k_proj.weight": k,
    }
    second = {
        "model.layers.0.self_attn.v_proj.weight": w(64, h, 1e-3),
        "model.layers.0.self_attn.o_proj.weight": w(h, h),
        "model.layers.0.mlp.gate_proj.weight": w(i, h),
        "model.layers.0.mlp.up_proj.weight": w(i, h),
        "model.layers.0.mlp.down_proj.weight": w(h, i),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
        "lm_head.weight": w(256, h),
    }
    root.mkdir()
    names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    save_file(first, root / names[0], metadata={"format": "pt"})
    save_file(second, root / names[1], metadata={"format": "pt"})
    index = {n: names[0] for n in first} | {n: names[1] for n in second}
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": h,
              "intermediate_size": i, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 32,
              "num_hidden_layers": 1, "vocab_size": 256, "torch_dtype": "bfloat16"}  # fmt: skip
    (root / "config.json").write_text(json.dumps(config))
    return root


def _same_folders(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir()) and any(n.endswith(".safetensors") for n in names)
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@needs_gpu
@pytest.mark.parametrize("scheme", SCHEMES)
def test_cuda_quantize_equals_cpu(tmp_path, scheme):
    src = _model(tmp_path / "base")
    common = ["--quantize", scheme, "--quantize-ignore", "lm_head", "-q"]
    cli("rewrite", src, "-o", tmp_path / "cpu", *common, check=0)
    cli("rewrite", src, "-o", tmp_path / "gpu", *common, "--device", "cuda", "--verify", check=0)
    _same_folders(tmp_path / "cpu", tmp_path / "gpu")


@needs_gpu
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_cuda_dequantize_equals_cpu(tmp_path, scheme, dtype):
    src = _model(tmp_path / "base")
    cli("rewrite", src, "-o", tmp_path / "q", "--quantize", scheme, "--quantize-ignore", "lm_head", "-q", check=0)
    cli("rewrite", tmp_path / "q", "-o", tmp_path / "cpu", "--dtype", dtype, "-q", check=0)
    cli("rewrite", tmp_path / "q", "-o", tmp_path / "gpu", "--dtype", dtype, "--device", "cuda", "--verify", "-q",
        check=0)  # fmt: skip
    _same_folders(tmp_path / "cpu", tmp_path / "gpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error when no GPU is present")
@pytest.mark.parametrize("how", [("--quantize", "NVFP4A16", "--quantize-ignore", "lm_head"), ("--dtype", "bf16")])
def test_cuda_quantize_without_gpu_is_one_line(tmp_path, how):
    src = _model(tmp_path / "base")
    if how[0] == "--dtype":  # a quantized source to dequantize
        cli("rewrite", src, "-o", tmp_path / "q", "--quantize", "FP8_BLOCK", "--quantize-pad-partial", "-q", check=0)
        src = tmp_path / "q"
    done = cli("rewrite", src, "-o", tmp_path / "out", *how, "--device", "cuda", check=2)
    assert "no usable CUDA device" in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "out").exists()
