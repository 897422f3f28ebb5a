"""--dtype leaves what transformers keeps in float32 (a model class's ``_keep_in_fp32_modules_strict``
under bf16, with ``_keep_in_fp32_modules`` under fp16) in float32, as
``from_pretrained(dtype=...)`` + ``save_pretrained`` does: the table's rows read against
transformers' own classes for every family, and the output against transformers' own save."""

from __future__ import annotations

import pytest
import torch
from helpers import cli
from moe_models import tiny_model
from safetensors.torch import load_file

import streamck
from streamck.plan.moe.families import FAMILIES

pytestmark = pytest.mark.filterwarnings("ignore")
KEEPING = sorted(mt for mt, fam in FAMILIES.items() if fam.fp32 or fam.fp32_fp16)
TORCH = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_table_is_transformers_own(model_type, moe_saves):
    """Each row's fp32 patterns are what the model's instance registers (its submodels' too)."""
    model = moe_saves.model(model_type)
    fam = FAMILIES[model_type]
    assert sorted(fam.fp32) == sorted(model._keep_in_fp32_modules_strict or ())
    assert sorted(fam.fp32_fp16) == sorted(model._keep_in_fp32_modules or ())


def _equal(got: dict, want: dict) -> None:
    assert set(got) == set(want), sorted(set(got) ^ set(want))[:10]
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), (k, got[k].dtype, v.dtype)


@pytest.mark.parametrize("dtype", sorted(TORCH))
@pytest.mark.parametrize("model_type", KEEPING)
def test_dtype_is_from_pretrained_in_that_dtype(model_type, dtype, moe_saves, tmp_path):
    """An fp32 save_pretrained folder and a trainer's runtime save, --dtype'd, equal what
    from_pretrained(dtype=...) then save_pretrained writes, float32 tensors and all."""
    hf, runtime = moe_saves.hf(model_type), moe_saves.runtime(model_type)
    type(moe_saves.model(model_type)).from_pretrained(hf, dtype=TORCH[dtype]).save_pretrained(tmp_path / "oracle")
    want = load_file(tmp_path / "oracle" / "model.safetensors")
    if dtype == "bf16" and FAMILIES[model_type].fp32:  # the case this guards: something stays float32
        assert any(v.dtype == torch.float32 for v in want.values())
    streamck.rewrite(hf, tmp_path / "out", dtype=dtype)
    _equal(load_file(tmp_path / "out" / "model.safetensors"), want)
    streamck.rewrite(runtime, tmp_path / "from_runtime", dtype=dtype)
    _equal(load_file(tmp_path / "from_runtime" / "model.safetensors"), want)


def test_cli_says_which_and_cast_still_wins(tmp_path):
    """The rewrite names what it kept; an explicit --cast of those tensors still casts them."""
    tiny_model("deepseek_v3").save_pretrained(tmp_path / "hf")
    done = cli("rewrite", str(tmp_path / "hf"), "-o", str(tmp_path / "out"), "--dtype", "bf16", check=0)
    assert "--dtype: 1 tensors kept in their stored dtype" in done.stderr, done.stderr
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in done.stderr
    out = load_file(tmp_path / "out" / "model.safetensors")
    assert out["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert out["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    cast = ("--cast", "*e_score_correction_bias=bf16")
    done = cli("rewrite", str(tmp_path / "hf"), "-o", str(tmp_path / "cast"), "--dtype", "bf16", *cast, check=0)
    assert "kept in their stored dtype" not in done.stderr
    out = load_file(tmp_path / "cast" / "model.safetensors")
    assert out["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.bfloat16
