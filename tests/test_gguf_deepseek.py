"""GGUF output of DeepSeek-V3 (#50, Build item 3): Multi-head Latent Attention (kv_b_proj split into
k_b / v_b as llama.cpp's convert_hf_to_gguf.py splits it), a dense first layer then MoE layers with
a shared expert, grouped sigmoid routing with its correction bias; the file the reference writes,
byte for byte, run in llama.cpp against transformers' log-probabilities.

The tokenizer is the llama-bpe test vocabulary (tests/gguf_deepseek_models.py): DeepSeek's own
vocabulary is not needed for anything the weights go through."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf_models
import pytest
from gguf_deepseek_models import fp8_model, reference_file, tiny_model
from gguf_env import contents, logprob_deltas, run_llama_cpp, write_gguf

PROMPT = [9906, 1917, 11, 420, 374, 264]
# (kind, outtype) the reference converts (each ~15 s cold, then cached)
REFERENCE = [("dsv3", "bf16"), ("dsv3", "q8_0"), ("dsv3-noq", "q8_0"), ("dsv3-yarn", "bf16")]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return {kind: tiny_model(tmp_path_factory, kind) for kind in ("dsv3", "dsv3-noq", "dsv3-yarn")}


@pytest.fixture(scope="module")
def written(models, tmp_path_factory):
    """streamck's GGUF of a model as a type, written once for the module's tests."""
    where, files = tmp_path_factory.mktemp("gguf-dsv3"), {}

    def get(kind: str, outtype: str) -> Path:
        if (kind, outtype) not in files:
            files[kind, outtype] = write_gguf(models[kind], where / f"{kind}-{outtype}" / "model.gguf", outtype)[0]
        return files[kind, outtype]

    return get


@pytest.mark.parametrize(("kind", "outtype"), REFERENCE)
def test_equals_the_reference(models, written, kind, outtype):
    """Every key (MLA's ranks and lengths, the routing keys, the key_length written twice as the
    reference writes it), every tensor info and every byte are the reference's."""
    ours = written(kind, outtype)
    ref = reference_file(models[kind], outtype)
    (ref_kvs, ref_infos, ref_data), (kvs, infos, data) = contents(ref), contents(ours)
    assert kvs == ref_kvs
    assert infos == ref_infos
    assert [n for n in data if data[n] != ref_data[n]] == []
    assert ours.read_bytes() == ref.read_bytes()


@pytest.fixture(scope="module")
def fp8(tmp_path_factory) -> tuple[Path, Path]:
    """``dsv3`` in DeepSeek's FP8 layout, and its dequantized float32 twin for transformers."""
    return fp8_model(tmp_path_factory, tiny_model(tmp_path_factory, "dsv3"), "dsv3")


@pytest.mark.parametrize("outtype", ["bf16", "q8_0"])
def test_an_fp8_source_equals_the_reference(fp8, tmp_path, outtype):
    """The FP8 folder (E4M3 weights beside 128x128 ``weight_scale_inv`` tiles, partial tiles
    included; experts, kv_b_proj and the shared expert among them) gives the reference's file
    from that same folder, which dequantizes it itself (``dequant_model``): streamck dequantizes
    each weight band by band (an expert stack one expert at a time, kv_b_proj whole to split it)."""
    ours = write_gguf(fp8[0], tmp_path / "model.gguf", outtype)[0]
    ref = reference_file(fp8[0], outtype)
    (ref_kvs, ref_infos, ref_data), (kvs, infos, data) = contents(ref), contents(ours)
    assert kvs == ref_kvs
    assert infos == ref_infos
    assert [n for n in data if data[n] != ref_data[n]] == []
    assert ours.read_bytes() == ref.read_bytes()


def test_an_fp8_source_of_another_family(tmp_path_factory, tmp_path):
    """The same dequantization serves the other families: the FP8 layout of the Qwen3-MoE of
    tests/test_gguf_moe.py (experts dequantized one after another into their stack) gives the
    reference's Q8_0 file."""
    src = fp8_model(tmp_path_factory, gguf_models.tiny_model(tmp_path_factory, "qwen3moe"), "qwen3moe")[0]
    ours = write_gguf(src, tmp_path / "model.gguf", "q8_0")[0]
    assert ours.read_bytes() == reference_file(src, "q8_0").read_bytes()


def test_what_the_file_holds(written):
    """What the equality above covers, seen in the file: k_b [H, kv_lora_rank, nope] and v_b
    [H, v, kv_lora_rank] (GGUF's axes reversed), the routing as keys, the bias as F32, experts
    stacked, MLA's one key-value head."""
    kvs, infos, _ = contents(written("dsv3", "q8_0"))
    keys = {k: v for k, _, v in kvs}
    shapes = {name: (shape, kind) for name, shape, kind, _ in infos}
    assert shapes["blk.1.attn_k_b.weight"] == ([32, 32, 4], "Q8_0")
    assert shapes["blk.1.attn_v_b.weight"] == ([32, 32, 4], "Q8_0")
    assert shapes["blk.1.exp_probs_b.bias"] == ([4], "F32")
    assert shapes["blk.1.ffn_gate_exps.weight"] == ([64, 32, 4], "Q8_0")
    assert "blk.0.ffn_gate.weight" in shapes and "blk.0.ffn_gate_exps.weight" not in shapes  # layer 0 is dense
    assert "deepseek2.attention.q_lora_rank" in keys and "blk.0.attn_q_a.weight" in shapes
    assert keys["deepseek2.expert_gating_func"] == 2  # sigmoid
    assert keys["deepseek2.attention.head_count_kv"] == 1 and keys["deepseek2.leading_dense_block_count"] == 1
    assert keys["deepseek2.expert_group_count"] == 2 and keys["deepseek2.expert_group_used_count"] == 1


TOLERANCE = {"f32": 1e-3, "bf16": 0.06, "q8_0": 0.3}  # |log p| difference, as tests/test_gguf.py's


def test_llama_cpp_runs_it(models, written, fp8, tmp_path, monkeypatch):
    """llama.cpp (one child) runs the f32, bf16 and Q8_0 files within TOLERANCE of transformers'
    log-probabilities (measured: 1.4e-5, 0.042, 0.18), and the model without q_lora_rank in f32
    (llama.cpp reads a DeepSeek without it only at DeepSeek-V2-Lite's 26 or 27 layers, so that
    model has 26; in bf16 and Q8_0 its depth drifts past the tolerance: those are checked against
    the reference only). The FP8 source's f32 file is within 1e-3 of transformers running its
    dequantized weights (measured: 1e-5; the bf16 model it was made from is 0.5 away), and so is
    the model with DeepSeek-V3's YaRN RoPE (1.1e-5). The same f32 file with k_b and v_b swapped,
    or with each layer's experts stacked in reverse order, or the YaRN one without its
    ``yarn_log_mul`` key, is off by far more (measured: 12.0, 6.8, 4.6), so the check can fail."""
    import gguf

    from streamck.writer.formats.gguf import experts, mla

    files = [written("dsv3", t) for t in TOLERANCE] + [written("dsv3-noq", "f32")]
    files += write_gguf(fp8[0], tmp_path / "fp8" / "model.gguf", "f32")
    files += write_gguf(models["dsv3-yarn"], tmp_path / "yarn" / "model.gguf", "f32")
    split = mla.split_kv_b
    monkeypatch.setattr(mla, "split_kv_b", lambda t, h: _swapped(*split(t, h)))
    files += write_gguf(models["dsv3"], tmp_path / "swapped" / "model.gguf", "f32")
    monkeypatch.undo()
    name = experts.Stacker._name
    monkeypatch.setattr(experts.Stacker, "_name", lambda s, layer, e, proj: name(s, layer, s.count - 1 - e, proj))
    files += write_gguf(models["dsv3"], tmp_path / "reversed" / "model.gguf", "f32")
    monkeypatch.undo()
    monkeypatch.setattr(gguf.GGUFWriter, "add_rope_scaling_yarn_log_mul", lambda self, value: None)
    files += write_gguf(models["dsv3-yarn"], tmp_path / "no-log-mul" / "model.gguf", "f32")
    runs = run_llama_cpp(files, PROMPT)
    for outtype, run in zip(TOLERANCE, runs, strict=False):
        worst, agree = logprob_deltas(models["dsv3"], PROMPT, run)
        assert len(run["tokens"]) == 8 and worst < TOLERANCE[outtype], (outtype, worst, agree)
    worst, agree = logprob_deltas(models["dsv3-noq"], PROMPT, runs[3])
    assert worst < TOLERANCE["f32"], (worst, agree)
    worst, agree = logprob_deltas(fp8[1], PROMPT, runs[4])
    assert worst < TOLERANCE["f32"], ("fp8", worst, agree)
    worst, agree = logprob_deltas(models["dsv3-yarn"], PROMPT, runs[5])
    assert worst < TOLERANCE["f32"], ("yarn", worst, agree)
    teeth = zip(("k_b/v_b swapped", "experts reversed", "no yarn_log_mul"), runs[6:], strict=True)
    for (what, run), kind in zip(teeth, ("dsv3", "dsv3", "dsv3-yarn"), strict=True):
        worst, _ = logprob_deltas(models[kind], PROMPT, run)
        assert worst > 20 * TOLERANCE["f32"], (what, worst)


def _swapped(k_b, v_b):
    """kv_b_proj's two halves under each other's names (the same shapes in this model)."""
    from streamck.plan import OutputTensor

    assert k_b.shape == v_b.shape
    return OutputTensor(k_b.name, v_b.source, v_b.dtype), OutputTensor(v_b.name, k_b.source, k_b.dtype)


def _edited(src: Path, dst: Path, config) -> Path:
    shutil.copytree(src, dst)
    (dst / "config.json").write_text(json.dumps(config(json.loads((dst / "config.json").read_text()))))
    return dst


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (lambda c: {**c, "scoring_func": "sqrtsoftplus"}, "config.json's routing function 'sqrtsoftplus'"),
        (lambda c: {**c, "v_head_dim": 48}, r"kv_b_proj.weight is \[256, 32\]: not num_key_value_heads x"),
        (lambda c: {k: v for k, v in c.items() if k != "qk_rope_head_dim"}, "config.json states no qk_rope_head_dim"),
        (lambda c: {**c, "rope_parameters": {"rope_type": "yarn", "factor": 40.0, "rope_theta": 10000.0}},
         "YaRN RoPE scaling has no original_max_position_embeddings"),
        (lambda c: {**c, "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}},
         "RoPE type 'linear'"),
    ],
    ids=["a-routing-function-gguf-py-lacks", "kv_b-of-another-shape", "a-missing-head-dim", "yarn-without-its-context",
         "linear-rope"],
)  # fmt: skip
def test_refusals(models, tmp_path, config, message):
    """Bad input: one line naming what is wrong, nothing written."""
    from streamck.errors import PlanError

    src = _edited(models["dsv3"], tmp_path / "src", config)
    out = tmp_path / "out.gguf"
    with pytest.raises(PlanError, match=message) as info:
        write_gguf(src, out)
    assert "\n" not in str(info.value) and not out.exists()


def test_cli_refuses_in_one_line(models, tmp_path):
    """The same from the command line: exit 2, one line, nothing at the output."""
    from helpers import cli

    src = _edited(models["dsv3"], tmp_path / "src", lambda c: {**c, "scoring_func": "sqrtsoftplus"})
    proc = cli("rewrite", src, "-o", tmp_path / "out.gguf", "--quantize", "Q8_0", check=2)
    assert "sqrtsoftplus" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "out.gguf").exists()
