"""--dtype on an FP8 source against transformers 5.19's own dequantization (tests/quant_oracles.py
load): DeepSeek-V3's layout (FineGrainedFP8Config(dequantize=True)) and compressed-tensors' FP8
per row and per 128×128 block (its decompressor, which transformers runs), to bf16, f16 and f32;
the scales dropped and quantization_config removed; without --dtype the source stays as it is."""

from __future__ import annotations

import json

import pytest
from dequant_fixtures import TORCH, dequantized, same
from helpers import cli
from quant_fixtures import quant  # noqa: F401  (a session fixture)
from test_quantize import tensors

pytest.importorskip("torch")

# (source folder, --dtype): a DeepSeek-layout FP8 model, and model_free_ptq's FP8_BLOCK (lm_head
# ignored: transformers loads a quantized embedding without its scale, so ct-FP8_DYNAMIC ignores it)
CASES = [("ds-fp8", "bf16"), ("ds-fp8", "f32"), ("ct-FP8_DYNAMIC", "bf16"), ("ct-FP8_DYNAMIC", "f16"),
         ("ct-FP8_DYNAMIC", "f32"), ("sharded-FP8_BLOCK", "bf16")]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_same_as_transformers(quant, tmp_path, case):  # noqa: F811
    src, dtype = case
    ours, oracle = dequantized(quant / src, dtype, tmp_path, "load")
    oracle = {k: v for k, v in oracle.items() if not k.endswith("weight_scale")}  # kept beside, unused
    assert sorted(ours) == sorted(oracle)
    differ = [n for n in ours if not same(ours[n], oracle[n])]
    assert not differ, f"{len(differ)} of {len(ours)} differ: {differ[:5]}"
    config = json.loads((tmp_path / "out" / "config.json").read_bytes())
    assert "quantization_config" not in config and config["dtype"] == TORCH[dtype]


def test_without_dtype_it_stays_quantized(quant, tmp_path):  # noqa: F811
    cli("rewrite", quant / "ds-fp8", "-o", tmp_path / "out", check=0)
    assert tensors(tmp_path / "out") == tensors(quant / "ds-fp8")
    assert "quantization_config" in json.loads((tmp_path / "out" / "config.json").read_bytes())
