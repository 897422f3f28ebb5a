"""GGUF output of a Llama with Llama 3.1's RoPE scaling (#50: ``rope_type: "llama3"``): the
reference's extra ``rope_freqs.weight`` tensor, computed from the config, and the reference's
file byte for byte; llama.cpp runs it with transformers' log-probabilities."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf_env import contents, logprob_deltas, run_llama_cpp, write_gguf
from gguf_models import llama_cpp, reference_file, tiny_model

# 200 ordinary ids: Llama 3's scaling changes only the low rotary frequencies, which tell apart
# only distant positions (with test_gguf.py's 6-token prompt, factors all 1 are off by < 0.01).
PROMPT = list(range(1000, 1200))
TOLERANCE = {"f32": 1e-3, "bf16": 0.06, "q8_0": 0.3}  # |log p| differences, as tests/test_gguf.py's


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_model(tmp_path_factory, "llama31")


@pytest.mark.parametrize("outtype", ["bf16", "q8_0"])
def test_equals_the_reference(model, tmp_path, outtype):
    """The reference's file, byte for byte: rope_freqs.weight first (F32, head_dim / 2 values),
    every other tensor, key and the whole file as its."""
    ours = write_gguf(model, tmp_path / "model.gguf", outtype)[0]
    ref = reference_file(model, outtype)
    (ref_kvs, ref_infos, ref_data), (kvs, infos, data) = contents(ref), contents(ours)
    assert infos[0][:3] == ref_infos[0][:3] == ("rope_freqs.weight", [32], "F32"), infos[0]
    assert kvs == ref_kvs
    assert infos == ref_infos
    assert [n for n in data if data[n] != ref_data[n]] == []
    assert ours.read_bytes() == ref.read_bytes()


def test_the_factors_are_scaled(model):
    """The tiny model's factors span the three cases (1, between, 32): the check above sees the
    smooth band's arithmetic, not only constants."""
    from streamck.writer.formats.gguf import meta, rope

    config = json.loads((model / "config.json").read_text())
    values = rope.factors(meta.rope_parameters(config), config)
    assert values[0] == 1 and values[-1] == 32
    assert ((values > 1) & (values < 32)).sum() >= 2


# Llama 3.1 (8B/70B/405B) and 3.3 (head_dim 128, factor 8), Llama 3.2 (1B: head_dim 64, 3B: 128; factor 32).
LLAMA3X = [(128, 8.0), (64, 32.0), (128, 32.0)]
REFERENCE = """
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/gguf-py"]
from types import SimpleNamespace
from conversion.llama import LlamaModel
for params, hparams in json.loads(sys.stdin.read()):
    fake = SimpleNamespace(rope_parameters=params, hparams=hparams, format_tensor_name=lambda kind: "rope_freqs")
    (_, t), = LlamaModel.generate_extra_tensors(fake)
    print(t.numpy().tobytes().hex())
"""


def test_factors_equal_the_references_for_llama3x():
    """The factors of Llama 3.1 / 3.2 / 3.3's own RoPE parameters are the bits the reference's
    ``generate_extra_tensors`` computes (in torch, run here), though our pow is rounded otherwise."""
    from streamck.writer.formats.gguf import rope

    cases = []
    for dim, factor in LLAMA3X:
        params = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": factor, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
        cases.append((params, {"hidden_size": dim * 32, "num_attention_heads": 32}))
    proc = subprocess.run([sys.executable, "-c", REFERENCE, str(llama_cpp())], input=json.dumps(cases),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = proc.stdout.split()
    assert len(expected) == len(cases)
    for (params, hparams), hexed in zip(cases, expected, strict=True):
        ours = rope.factors(params, hparams)
        assert ours.tobytes().hex() == hexed, np.frombuffer(bytes.fromhex(hexed), "<f4") - ours


@pytest.fixture(scope="module")
def runs(model, tmp_path_factory) -> dict[str, dict]:
    """llama.cpp's runs of the model as f32, bf16 and Q8_0, and as f32 with every factor 1 (the
    scaling left out: ``unscaled``), all in one child process."""
    from streamck.writer.formats.gguf import rope

    tmp = tmp_path_factory.mktemp("rope-runs")
    paths = {t: write_gguf(model, tmp / f"{t}.gguf", t)[0] for t in TOLERANCE}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rope, "factors", lambda p, h: np.ones(32, "<f4"))
        paths["unscaled"] = write_gguf(model, tmp / "unscaled.gguf", "f32")[0]
    return dict(zip(paths, run_llama_cpp(list(paths.values()), PROMPT), strict=True))


@pytest.mark.parametrize("outtype", list(TOLERANCE))
def test_llama_cpp_runs_it(model, runs, outtype):
    """llama.cpp's log-probabilities for 8 greedy steps after PROMPT are within TOLERANCE of
    transformers' (which applies the llama3 scaling too); f32's greedy tokens are transformers'
    (measured: 2e-5, 0.016 and 0.098 for f32, bf16 and Q8_0)."""
    worst, agree = logprob_deltas(model, PROMPT, runs[outtype])
    assert len(runs[outtype]["tokens"]) == 8
    assert worst < TOLERANCE[outtype], (worst, agree)
    if outtype == "f32":
        assert agree == 8


def test_llama_cpp_tells_missing_factors(model, runs):
    """The check above has teeth: the same file with every factor 1 (no scaling) runs, but far
    from transformers' log-probabilities (measured: 0.17, against f32's 2e-5)."""
    worst, _ = logprob_deltas(model, PROMPT, runs["unscaled"])
    assert worst > 100 * TOLERANCE["f32"], worst


def test_refuses_llama3_rope_where_the_reference_writes_no_tensor(tmp_path):
    """A family the reference converts without generate_extra_tensors (Qwen3) is refused in one line."""
    import gguf

    from streamck.errors import PlanError
    from streamck.writer.formats.gguf import meta, table

    config = {"num_hidden_layers": 1, "vocab_size": 8, "hidden_size": 8, "num_attention_heads": 2,
              "rope_parameters": {"rope_type": "llama3", "rope_theta": 1e6}}  # fmt: skip
    w = gguf.GGUFWriter(path=None, arch="qwen3")
    with pytest.raises(PlanError, match="RoPE type 'llama3'") as info:
        meta.add_parameters(w, table.FAMILIES["Qwen3ForCausalLM"], config, 1)
    assert "\n" not in str(info.value)
    meta.add_parameters(w, table.FAMILIES["LlamaForCausalLM"], config, 1)  # the Llama family writes it
