"""The GGUF tests' fixtures, kept in the fixture cache keyed by this file: llama.cpp's reference
converter and tiny models with their reference conversions.

- The reference: ``convert_hf_to_gguf.py`` with the gguf-py beside it, from the llama-cpp-python
  0.3.36 sdist (``pip download``, unpacked once into the fixture cache), run with this venv's
  torch and transformers in a child process.
- The models: a Llama 3 and a Qwen3 with 2 layers and random bf16 weights, saved by
  ``save_pretrained``, with a tokenizer built by the ``tokenizers`` library from the vocabulary
  and merges that llama.cpp ships for its tokenizer tests (``models/ggml-vocab-llama-bpe.gguf``,
  ``ggml-vocab-qwen2.gguf``) and the pre-tokenizer regex of that family's tokenizer.json: its
  ids for the reference's check text are the real model's, so the reference recognises it
  (``llama-bpe``, ``qwen2``) by the same sha256 it recognises Meta-Llama-3 and Qwen by.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from fixture_cache import built_once, cache_dir, fixture_root

LLAMA_CPP_PYTHON = "0.3.36"
_WORDS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_REST = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# the pre_tokenizer Split regex of each family's tokenizer.json: digits in threes (Llama 3) or one by one (Qwen2)
SPLIT_PATTERNS = {"llama-bpe": _WORDS + r"\p{N}{1,3}" + _REST, "qwen2": _WORDS + r"\p{N}" + _REST}


def llama_cpp() -> Path:
    """The vendored llama.cpp folder of the llama-cpp-python sdist, unpacked once per machine."""
    base = cache_dir() / f"llama-cpp-python-{LLAMA_CPP_PYTHON}"

    def build(tmp: Path) -> None:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(tmp),
               f"llama-cpp-python=={LLAMA_CPP_PYTHON}"]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, timeout=900)
        sdist = tmp / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
        keep = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "models/ggml-vocab-")
        prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
        with tarfile.open(sdist) as tar:
            members = [
                m for m in tar.getmembers() if m.name.startswith(prefix) and m.name[len(prefix) :].startswith(keep)
            ]
            for m in members:
                m.name = m.name[len(prefix) :]
            tar.extractall(tmp / "llama.cpp", members=members, filter="data")
        sdist.unlink()

    return built_once(base, build) / "llama.cpp"


def make_tokenizer(vocab_gguf: Path, pre: str, out: Path) -> None:
    """tokenizer.json and tokenizer_config.json in ``out`` for the vocabulary of ``vocab_gguf``
    (tokens, types, merges), pre-tokenized as the family's tokenizer.json does."""
    sys.path.insert(0, str(llama_cpp() / "gguf-py"))
    try:
        import gguf
    finally:
        sys.path.pop(0)
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    reader = gguf.GGUFReader(vocab_gguf)
    field = reader.fields
    tokens = [str(bytes(field["tokenizer.ggml.tokens"].parts[i]), "utf-8") for i in field["tokenizer.ggml.tokens"].data]
    types = [int(field["tokenizer.ggml.token_type"].parts[i][0]) for i in field["tokenizer.ggml.token_type"].data]
    merges = [str(bytes(field["tokenizer.ggml.merges"].parts[i]), "utf-8") for i in field["tokenizer.ggml.merges"].data]
    normal = {t: i for i, (t, k) in enumerate(zip(tokens, types, strict=True)) if k == gguf.TokenType.NORMAL}
    control = [(t, i) for i, (t, k) in enumerate(zip(tokens, types, strict=True)) if k == gguf.TokenType.CONTROL]
    model = models.BPE(normal, [tuple(m.split(" ")) for m in merges], ignore_merges=pre == "llama-bpe")
    tok = Tokenizer(model)
    split = pre_tokenizers.Split(Regex(SPLIT_PATTERNS[pre]), behavior="isolated", invert=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, _ in control])
    assert all(tok.token_to_id(t) == i for t, i in control), "special tokens out of place"
    bos, eos = (control[0][0], control[1][0]) if pre == "llama-bpe" else (None, control[0][0])
    if pre == "llama-bpe":
        template = processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                                 special_tokens=[(bos, control[0][1])])  # fmt: skip
        tok.post_processor = processors.Sequence([processors.ByteLevel(trim_offsets=False), template])
    else:
        tok.normalizer = normalizers.NFC()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.save(str(out / "tokenizer.json"))
    config = {"bos_token": bos, "eos_token": eos, "model_max_length": 131072,
              "tokenizer_class": "PreTrainedTokenizerFast" if pre == "llama-bpe" else "Qwen2Tokenizer",
              "chat_template": "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"}  # fmt: skip
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


CONFIGS = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=64,
                  intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
                  bos_token_id=128000, eos_token_id=128001),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=64,
                  intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                  bos_token_id=151643, eos_token_id=151645),
}  # fmt: skip
VOCABS = {"llama": ("ggml-vocab-llama-bpe.gguf", "llama-bpe"), "qwen3": ("ggml-vocab-qwen2.gguf", "qwen2")}


def make_model(kind: str, out: Path, seed: int = 0) -> None:
    """A tiny ``kind`` model with random bf16 weights, saved by save_pretrained in ``out`` with its
    tokenizer (make_tokenizer). Matrices have std 0.15: logits far from flat, yet a network that
    does not amplify llama.cpp's bf16 and Q8_0 activation rounding into different tokens."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(**CONFIGS[kind])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.15) if p.ndim > 1 else p.uniform_(0.5, 1.5)
    model.to(torch.bfloat16).save_pretrained(out)
    vocab, pre = VOCABS[kind]
    make_tokenizer(llama_cpp() / "models" / vocab, pre, out)


def tiny_model(tmp_path_factory, kind: str) -> Path:
    """The ``kind`` model's folder, built once per machine (keyed by this file and the packages)."""
    root = fixture_root(tmp_path_factory, f"gguf-{kind}", "tests/gguf_models.py")
    return built_once(root / "model", lambda tmp: make_model(kind, tmp))


def reference_file(model: Path, outtype: str) -> Path:
    """The reference's GGUF of ``model`` (tiny_model's folder) as ``outtype``, kept beside it."""
    base = built_once(model.parent / f"reference-{outtype}", lambda tmp: reference(model, tmp / "model.gguf", outtype))
    return base / "model.gguf"


def reference(model: Path, out: Path, outtype: str, *extra: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """llama.cpp's ``convert_hf_to_gguf.py MODEL --outfile OUT --outtype OUTTYPE`` with its own
    gguf-py, in a child (this venv's torch and transformers), output captured."""
    script = llama_cpp() / "convert_hf_to_gguf.py"
    cmd = [sys.executable, str(script), str(model), "--outfile", str(out), "--outtype", outtype, *extra]
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc
