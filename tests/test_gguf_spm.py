"""GGUF output of a SentencePiece Llama and Mistral (#50: ``tokenizer.model``): the vocabulary as
convert_hf_to_gguf.py writes it (pieces, scores and types from the ``sentencepiece`` library),
byte for byte, and files llama.cpp runs with transformers' logits. The tokenizer is trained by
the test (bench/gguf_ckpt.py ``make_sentencepiece``); the Mistral is the Llama's weights (the same
seed and shapes) under ``MistralForCausalLM``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from gguf_env import contents, logprob_deltas, run_llama_cpp, write_gguf
from gguf_models import reference_file, tiny_model

# ids of ordinary pieces whose greedy continuation (transformers) has no byte pieces: llama.cpp's
# server reports a byte piece's step together with the next, which would shift the comparison
PROMPT = [363, 584, 290, 281, 285, 924]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return {kind: tiny_model(tmp_path_factory, kind) for kind in ("llama2", "mistral")}


@pytest.fixture(scope="module")
def model(models) -> Path:
    return models["llama2"]


@pytest.fixture(scope="module")
def written(models, tmp_path_factory):
    """streamck's GGUF of a model as a type (the Llama's by default), written once for the module."""
    where, files = tmp_path_factory.mktemp("gguf-spm"), {}

    def get(outtype: str, kind: str = "llama2") -> Path:
        if (kind, outtype) not in files:
            files[kind, outtype] = write_gguf(models[kind], where / f"{kind}-{outtype}" / "model.gguf", outtype)[0]
        return files[kind, outtype]

    return get


@pytest.mark.parametrize(("kind", "outtype"), [("llama2", "bf16"), ("llama2", "q8_0"), ("mistral", "bf16")])
def test_equals_the_reference(models, written, kind, outtype):
    """Every key (the SentencePiece vocabulary: tokens, scores, types; the special ids), every
    tensor info and every byte are the reference's."""
    ours, ref = written(outtype, kind), reference_file(models[kind], outtype)
    (ref_kvs, ref_infos, _), (kvs, infos, _) = contents(ref), contents(ours)
    assert kvs == ref_kvs and infos == ref_infos
    assert ours.read_bytes() == ref.read_bytes()


def test_the_vocabulary_is_sentencepieces(model, written):
    """What the equality covers, seen in the file: the ``llama`` tokenizer model, every piece
    with the score and type sentencepiece gives it (bytes typed BYTE), but for the special
    tokens tokenizer_config.json lists (``<unk>``, ``<s>``, ``</s>``: CONTROL, score -1000, the
    reference's rule)."""
    import gguf
    from sentencepiece import SentencePieceProcessor

    kvs = {k: v for k, _, v in contents(written("bf16"), limit=1 << 20)[0]}
    sp = SentencePieceProcessor(model_file=str(model / "tokenizer.model"))
    assert kvs["tokenizer.ggml.model"] == b"llama" and kvs["tokenizer.ggml.pre"] == b"default"
    tokens, scores, types = (kvs[f"tokenizer.ggml.{k}"][1] for k in ("tokens", "scores", "token_type"))
    assert [t.decode() for t in tokens] == [sp.IdToPiece(i) for i in range(sp.vocab_size())] and len(tokens) == 1000
    assert scores[:3] == (-1000.0,) * 3 and all(s == sp.GetScore(i) for i, s in enumerate(scores) if i >= 3)
    assert types[:3] == (gguf.TokenType.CONTROL,) * 3 and sp.IsUnknown(0) and sp.IsControl(1)
    assert types[3:259] == (gguf.TokenType.BYTE,) * 256 and types[500] == gguf.TokenType.NORMAL


def test_the_tokenizer_json_is_the_sentencepiece_models(model):
    """The fixture's tokenizer.json (transformers' conversion of tokenizer.model) tokenizes as
    sentencepiece does, byte fallback included: transformers and llama.cpp see one vocabulary."""
    from sentencepiece import SentencePieceProcessor
    from tokenizers import Tokenizer

    sp = SentencePieceProcessor(model_file=str(model / "tokenizer.model"))
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    texts = ["kalo mine shi po 123", "zebedo, 42. anel!", "ünïcödé and 🦙", "two  spaces  inside"]
    assert [tok.encode(t, add_special_tokens=False).ids for t in texts] == [sp.encode(t) for t in texts]


TOLERANCE = {"f32": 1e-3, "q8_0": 0.3}  # |log p| difference, as tests/test_gguf.py's


def test_llama_cpp_runs_it(models, written):
    """llama.cpp (one child) runs the Llama's f32 and Q8_0 files and the Mistral's f32 one within
    TOLERANCE of transformers' log-probabilities (measured: 2.4e-6, 0.19, 2.4e-6)."""
    cases = [("llama2", "f32"), ("llama2", "q8_0"), ("mistral", "f32")]
    runs = run_llama_cpp([written(outtype, kind) for kind, outtype in cases], PROMPT)
    for (kind, outtype), run in zip(cases, runs, strict=True):
        worst, agree = logprob_deltas(models[kind], PROMPT, run)
        assert len(run["tokens"]) == 8 and worst < TOLERANCE[outtype], (kind, outtype, worst, agree)


def test_refuses_sentencepiece_where_the_family_reads_bpe(model, tmp_path):
    """A family whose converter never reads tokenizer.model (Qwen3-MoE) with one: one line, nothing written."""
    from streamck.errors import PlanError

    src = tmp_path / "src"
    shutil.copytree(model, src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4}))
    with pytest.raises(PlanError, match=r"a SentencePiece tokenizer \(tokenizer.model\) for QWEN3MOE") as info:
        write_gguf(src, tmp_path / "out.gguf")
    assert "\n" not in str(info.value) and not (tmp_path / "out.gguf").exists()
