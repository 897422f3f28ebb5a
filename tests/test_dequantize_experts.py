"""Experts and their FP8 scales move together (#41): --fuse-experts on a per-expert FineGrainedFP8 MoE
(DeepSeek-V3's layout: tests/dequant_oracles.py relabel of model_free_ptq's FP8_BLOCK Qwen3-MoE) fuses each
expert's weight_scale_inv with its weight, as transformers' FP8Experts holds them; the per-expert split
(the default on fused experts) cuts them back; dequantizing the fused result equals fusing the
dequantized model, bit for bit; quantization with no fused layout (compressed-tensors) is refused."""

from __future__ import annotations

import pytest
from dequant_fixtures import native  # noqa: F401  (a session fixture)
from helpers import cli
from quant_fixtures import quant  # noqa: F401  (a session fixture)
from test_quantize import tensors

pytest.importorskip("torch")

BLOCK = "model.layers.0.mlp.experts."


def _rewrite(src, out, *flags):
    cli("rewrite", src, "-o", out, *flags, check=0)
    return tensors(out)


def test_fuse_carries_the_scales_and_the_split_cuts_them_back(native, tmp_path):  # noqa: F811
    src = native / "moe-fp8"
    fused = _rewrite(src, tmp_path / "fused", "--fuse-experts")
    assert not [n for n in fused if ".experts." in n and n.rpartition(".")[2] not in (
        "gate_up_proj", "down_proj", "gate_up_proj_scale_inv", "down_proj_scale_inv")]  # fmt: skip
    assert fused[BLOCK + "gate_up_proj_scale_inv"][:2] == ("BF16", [4, 2, 2])
    # the default on fused experts writes them per expert, as save_pretrained does: the source again
    assert _rewrite(tmp_path / "fused", tmp_path / "split") == tensors(src)


def test_dequantizing_the_fused_equals_fusing_the_dequantized(native, tmp_path):  # noqa: F811
    src = native / "moe-fp8"
    _rewrite(src, tmp_path / "fused", "--fuse-experts")
    a = _rewrite(tmp_path / "fused", tmp_path / "a", "--dtype", "bf16", "--keep-fused")
    _rewrite(src, tmp_path / "deq", "--dtype", "bf16")
    b = _rewrite(tmp_path / "deq", tmp_path / "b", "--fuse-experts")
    assert BLOCK + "gate_up_proj" in a and a == b


def test_fuse_refuses_compressed_tensors_experts(quant, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    proc = cli("rewrite", quant / "qwen3moe-FP8_BLOCK", "-o", out, "--fuse-experts")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "weight_scale" in lines[0] and "--dtype" in lines[0] and not out.exists()


def test_fuse_refuses_scales_whose_tiles_straddle_gate_and_up(native, tmp_path):  # noqa: F811
    """Experts whose intermediate size (here cut to 96 rows) is no multiple of the 128-row tile: gate's
    last tile and up's first would share a fused tile, so the scales cannot be fused; refused, not written."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder, out = tmp_path / "i96", tmp_path / "out"
    shutil.copytree(native / "moe-fp8", folder)
    for index in folder.glob("*.index.json"):
        index.unlink()
    (path,) = folder.glob("*.safetensors")
    cut = {k: v[:96].contiguous() if k.endswith(("gate_proj.weight", "up_proj.weight")) and ".experts." in k
           else v[:, :96].contiguous() if k.endswith("down_proj.weight") and ".experts." in k else v
           for k, v in load_file(path).items()}  # fmt: skip
    save_file(cut, path)
    proc = cli("rewrite", folder, "-o", out, "--fuse-experts")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "96 rows" in lines[0] and "128-row" in lines[0] and not out.exists()
    cli("rewrite", folder, "-o", tmp_path / "deq", "--dtype", "bf16", check=0)  # dequantized, it fuses
    cli("rewrite", tmp_path / "deq", "-o", out, "--fuse-experts", check=0)
