"""--dtype on each native quantized layout, bit for bit against its own loader (tests/dequant_oracles.py):
gpt-oss's MXFP4 experts as transformers' Mxfp4Config(dequantize=True) loads them (and the output loads in
transformers with the same logits); FineGrainedFP8 with partial 128-tiles and BF16 scales, and with
E8M0 scales (scale_fmt ue8m0); compressed-tensors FP8_BLOCK weights 128 columns wide or less, whose
block scale [rows/128, 1] is read as the config's block strategy; refusals of damaged scales."""

from __future__ import annotations

import json
import shutil

import pytest
from dequant_fixtures import TORCH, dequantized, native, run_dequant_oracle, same  # noqa: F401
from helpers import cli
from quant_fixtures import quant  # noqa: F401  (a session fixture)

torch = pytest.importorskip("torch")
from safetensors.torch import load_file, save_file  # noqa: E402


def _load(folder) -> dict:
    return {k: v for p in sorted(folder.glob("*.safetensors")) for k, v in load_file(p).items()}


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_gptoss_mxfp4_as_transformers_loads_it(native, tmp_path, dtype):  # noqa: F811
    out = tmp_path / "out"
    cli("rewrite", native / "gptoss", "-o", out, "--dtype", dtype, "--verify", check=0)
    ours, hf = _load(out), load_file(native / f"gptoss-{dtype}.safetensors")
    assert sorted(ours) == sorted(hf)
    experts = [n for n in ours if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(experts) == 4 and ours["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 128, 192)
    # transformers leaves the dequantized experts in bfloat16 whatever the model's dtype: cast for the check
    want = getattr(torch, TORCH[dtype])
    assert {t.dtype for t in ours.values()} == {want}
    assert [n for n in ours if not same(ours[n], hf[n].to(want))] == []
    config = json.loads((out / "config.json").read_bytes())
    assert "quantization_config" not in config
    if dtype == "bf16":
        run_dequant_oracle("gptoss_logits", out, native / "gptoss")


def _block_definition(q, s, dtype):
    """Each 128×128 tile of E4M3 ``q`` times its own scale (partial last tiles too), in float32, rounded once."""
    rows, cols = q.shape
    grid = s.to(torch.float32).repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    return (q.to(torch.float32) * grid).to(dtype)


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_fineGrainedFP8_partial_tiles_are_the_block_math(native, tmp_path, dtype):  # noqa: F811
    """transformers 5.19 refuses (or, where rows ÷ scale rows is whole, mis-tiles) a weight whose last
    tile is partial, so there the oracle is the block definition in torch; where the tiles are whole it is
    transformers' own Fp8Dequantize."""
    src = native / "fp8-partial"
    ours, hf = dequantized(src, dtype, tmp_path, "fp8_ops")
    stored, want = _load(src), getattr(torch, TORCH[dtype])
    weights = [n.removesuffix("_scale_inv") for n in stored if n.endswith(".weight_scale_inv")]
    partial = [n for n in weights if stored[n].shape[0] % 128 or stored[n].shape[1] % 128]
    assert partial and hf and {stored[n + "_scale_inv"].dtype for n in weights} == {torch.bfloat16}
    assert [n for n in weights if not same(ours[n], _block_definition(stored[n], stored[n + "_scale_inv"], want))] == []
    assert sorted(hf) == sorted(set(weights) - set(partial))
    assert [n for n in hf if not same(ours[n], hf[n])] == []


def test_ue8m0_scales_as_transformers_loads_them(native, tmp_path):  # noqa: F811
    src = native / "ue8m0"
    assert json.loads((src / "config.json").read_text())["quantization_config"]["scale_fmt"] == "ue8m0"
    assert {v.dtype for k, v in _load(src).items() if k.endswith("_scale_inv")} == {torch.float8_e8m0fnu}
    ours, hf = dequantized(src, "bf16", tmp_path, "load")
    assert sorted(ours) == sorted(hf) and [n for n in ours if not same(ours[n], hf[n])] == []


def test_compressed_tensors_block_strategy_from_the_config(native, tmp_path):  # noqa: F811
    """FP8_BLOCK on weights 128 columns wide or less: the scale [rows/128, 1] is a column of tiles, not
    a scale per row (what its shape alone would suggest), as the config's block_structure says."""
    src = native / "ct128"
    scales = {k: v for k, v in _load(src).items() if k.endswith(".weight_scale")}
    assert any(1 < s.shape[0] and s.shape[1] == 1 for s in scales.values())
    ours, ct = dequantized(src, "bf16", tmp_path, "ct-decompress")
    assert len(ct) == len(scales) and [n for n in ct if not same(ours[n], ct[n])] == []


def _damaged(src, tmp_path, name, change) -> object:
    """A copy of ``src`` whose tensor ``name`` is changed by ``change`` (None: dropped)."""
    folder = tmp_path / "damaged"
    shutil.copytree(src, folder)
    for index in folder.glob("*.index.json"):  # one file: the index would name the dropped tensor
        index.unlink()
    (path,) = folder.glob("*.safetensors")
    tensors = load_file(path)
    value = tensors.pop(name)
    value = change(value).contiguous() if change else None
    save_file({**tensors, **({name: value} if value is not None else {})}, path)
    return folder


LAYER, UP = "model.layers.1.mlp.experts.", "model.layers.0.mlp.up_proj."
DAMAGE = [
    ("gptoss", LAYER + "down_proj_scales", None, LAYER + "down_proj_blocks", "no"),
    ("gptoss", LAYER + "down_proj_scales", lambda t: t[:, :-1], LAYER + "down_proj_scales", "[4, 128, 3]"),
    ("gptoss", LAYER + "gate_up_proj_blocks", lambda t: t[..., :8].contiguous(), LAYER + "gate_up_proj_blocks", "16"),
    ("fp8-partial", UP + "weight_scale_inv", None, UP + "weight", "without"),
    ("fp8-partial", UP + "weight_scale_inv", lambda t: t[:2].contiguous(), UP + "weight_scale_inv", "[3, 2]"),
]  # fmt: skip


@pytest.mark.parametrize("case", DAMAGE, ids=lambda c: f"{c[0]}-{c[1].rpartition('.')[2]}-{c[2] and 'shape'}")
def test_damaged_scales_refused_in_one_line(native, tmp_path, case):  # noqa: F811
    src, name, change, named, word = case
    folder, out = _damaged(native / src, tmp_path, name, change), tmp_path / "out"
    proc = cli("rewrite", folder, "-o", out, "--dtype", "bf16")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert named in lines[0] and word in lines[0], lines[0]
    assert not out.exists()
