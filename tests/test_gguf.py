"""GGUF output (#50): the file llama.cpp's convert_hf_to_gguf.py writes, byte for byte, and
one llama.cpp runs with transformers' logits (tests/gguf_models.py and gguf_env.py build both sides)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from gguf_env import contents, logprob_deltas, run_llama_cpp, write_gguf
from gguf_models import reference_file, tiny_model

KINDS = ("llama", "qwen3")
OUTTYPES = ("bf16", "f16", "f32", "q8_0")
PROMPT = [9906, 1917, 11, 420, 374, 264]  # ids both vocabularies hold


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return {kind: tiny_model(tmp_path_factory, kind) for kind in KINDS}


@pytest.mark.parametrize("outtype", OUTTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_equals_the_reference(models, tmp_path, kind, outtype):
    """Every key-value pair (name, type, value, order), every tensor info (name, shape, GGML
    type, offset) and every tensor's bytes are the reference's; so is the whole file."""
    ours = write_gguf(models[kind], tmp_path / "model.gguf", outtype)
    assert [p.name for p in ours] == ["model.gguf"]
    ref = reference_file(models[kind], outtype)
    (ref_kvs, ref_infos, ref_data), (kvs, infos, data) = contents(ref), contents(ours[0])
    assert [k for k, _, _ in kvs] == [k for k, _, _ in ref_kvs]
    assert kvs == ref_kvs
    assert infos == ref_infos and len(infos) > 10
    assert [n for n in data if data[n] != ref_data[n]] == []
    assert ours[0].read_bytes() == ref.read_bytes()


def test_types_are_the_references_choice(models, tmp_path):
    """Q8_0 quantizes the matrices and keeps norms in F32 (the reference's rule, seen in the file)."""
    _, infos, _ = contents(write_gguf(models["qwen3"], tmp_path / "q.gguf", "q8_0")[0])
    types = {name: kind for name, _, kind, _ in infos}
    assert types["blk.0.attn_q.weight"] == "Q8_0" and types["token_embd.weight"] == "Q8_0"
    assert types["blk.0.attn_norm.weight"] == "F32" and types["blk.0.attn_q_norm.weight"] == "F32"
    assert "output.weight" not in types  # Qwen3's tied head: llama.cpp reuses token_embd


TOLERANCE = {"f32": 1e-3, "f16": 0.06, "bf16": 0.06, "q8_0": 0.3}  # |log p| difference, see test_llama_cpp_runs_it


@pytest.mark.parametrize("outtype", ["f32", "bf16", "q8_0"])
@pytest.mark.parametrize("kind", KINDS)
def test_llama_cpp_runs_it(models, tmp_path, kind, outtype):
    """llama.cpp (CPU, f32 KV cache, no flash attention) gives log-probabilities within
    TOLERANCE of transformers' for 8 greedy steps: f32 weights to 1e-3; bf16 (llama.cpp rounds
    activations to bf16 for bf16 matmuls) to 0.06; Q8_0 (weights and activations in 8 bits) to 0.3
    (measured: < 5e-5, 0.024 and 0.105 at most)."""
    path = write_gguf(models[kind], tmp_path / "model.gguf", outtype)[0]
    run = run_llama_cpp(path, PROMPT)
    worst, agree = logprob_deltas(models[kind], PROMPT, run)
    assert len(run["tokens"]) == 8
    assert worst < TOLERANCE[outtype], (worst, agree)
    if outtype == "f32":
        assert agree == 8


def test_llama_cpp_tells_an_unpermuted_llama(models, tmp_path, monkeypatch):
    """The check above has teeth: Llama's q/k rows left in Hugging Face's order (no permutation)
    load and run, but their log-probabilities are far from transformers'."""
    from streamck.writer.formats.gguf import table

    monkeypatch.setitem(table.FAMILIES, "LlamaForCausalLM", table.FAMILIES["LlamaForCausalLM"].__class__(
        "LLAMA", permute_qk=False, vocab_size_key=True, rope_dims_key=True))  # fmt: skip
    path = write_gguf(models["llama"], tmp_path / "model.gguf", "f32")[0]
    worst, _ = logprob_deltas(models["llama"], PROMPT, run_llama_cpp(path, PROMPT))
    assert worst > 100 * TOLERANCE["f32"]


def _broken(models, tmp_path, edit) -> Path:
    src = tmp_path / "src"
    shutil.copytree(models["llama"], src)
    edit(src)
    return src


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: (d / "tokenizer.json").unlink(), "needs the model's tokenizer.json"),
        (lambda d: (d / "config.json").unlink(), "needs the model's config.json"),
        (lambda d: (d / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "num_hidden_layers": 2}'),
         "architecture GPT2LMHeadModel: GGUF output does not convert it"),
    ],
    ids=["no-tokenizer", "no-config", "unknown-arch"],
)  # fmt: skip
def test_refusals(models, tmp_path, edit, message):
    """Bad input: one line naming what is wrong, nothing written."""
    from streamck.errors import PlanError

    src = _broken(models, tmp_path, edit)
    out = tmp_path / "out.gguf"
    with pytest.raises(PlanError, match=message) as info:
        write_gguf(src, out)
    assert "\n" not in str(info.value) and not out.exists()


def test_refuses_a_tensor_with_no_gguf_name(models, tmp_path):
    from safetensors.torch import load_file, save_file

    from streamck.errors import PlanError

    def extra(d: Path) -> None:
        tensors = load_file(d / "model.safetensors")
        tensors["model.layers.0.mlp.foo.weight"] = tensors["model.norm.weight"].clone()
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})

    src = _broken(models, tmp_path, extra)
    with pytest.raises(PlanError, match="model.layers.0.mlp.foo.weight has no GGUF name for llama"):
        write_gguf(src, tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()


@pytest.mark.parametrize("kind", KINDS)
def test_the_tokenizers_are_the_families(models, kind):
    """The tests' tokenizers tokenize llama.cpp's own tokenizer test texts into the ids llama.cpp
    expects of Llama 3 / Qwen2 (models/ggml-vocab-*.gguf.inp and .out)."""
    from gguf_ckpt import VOCABS
    from gguf_models import llama_cpp
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(models[kind] / "tokenizer.json"))
    base = llama_cpp() / "models" / VOCABS[kind][0]
    texts = Path(f"{base}.inp").read_text().split("\n__ggml_vocab_test__\n")
    expected = Path(f"{base}.out").read_text().split("\n")
    got = [" ".join(map(str, tok.encode(t, add_special_tokens=False).ids)) for t in texts]
    assert len(texts) > 40 and got == [e.strip() for e in expected[: len(texts)]]


def test_split_files_equal_the_references(models, tmp_path):
    """``max_shard_size`` writes the files the reference's ``--split-max-size`` writes
    (OUT-0000K-of-0000N.gguf, split.* keys), byte for byte."""
    from gguf_models import reference

    (tmp_path / "ours").mkdir(), (tmp_path / "ref").mkdir()
    ours = write_gguf(models["llama"], tmp_path / "ours" / "model.gguf", "bf16", max_size=10_000_000)
    reference(models["llama"], tmp_path / "ref" / "model.gguf", "bf16", "--split-max-size", "10M")
    names = sorted(p.name for p in (tmp_path / "ref").iterdir())
    assert [p.name for p in ours] == names and len(names) > 2
    assert names[0] == f"model-00001-of-{len(names):05d}.gguf"
    for name in names:
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "ref" / name).read_bytes(), name


def test_cli_writes_the_references_file(models, tmp_path):
    """``streamck rewrite SRC -o OUT.gguf`` (bf16 source, no --dtype: the reference's auto) is
    the reference's bf16 file."""
    from helpers import cli

    cli("rewrite", models["qwen3"], "-o", tmp_path / "out.gguf", check=0)
    assert (tmp_path / "out.gguf").read_bytes() == reference_file(models["qwen3"], "bf16").read_bytes()


def test_cli_refuses_in_one_line(models, tmp_path):
    """An architecture with no table row: exit 2, one line naming it, nothing at the output."""
    from helpers import cli

    src = _broken(models, tmp_path, lambda d: (d / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}'))
    proc = cli("rewrite", src, "-o", tmp_path / "out.gguf", check=2)
    assert "GPT2LMHeadModel" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "out.gguf").exists()
