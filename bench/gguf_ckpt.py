"""The GGUF case's (and the GGUF tests') models: a Llama 3 or a Qwen3 with random bf16 weights,
saved by ``save_pretrained``, with a tokenizer built by the ``tokenizers`` library from the
vocabulary and merges llama.cpp ships for its own tokenizer tests (``models/ggml-vocab-*.gguf``)
and that family's pre-tokenizer: its ids for the reference's check text are the real model's, so
``convert_hf_to_gguf.py`` recognises it (``llama-bpe``, ``qwen2``) by the hash it recognises
Meta-Llama-3 and Qwen by. The reference itself comes from the llama-cpp-python sdist (fetch_llama_cpp).

    python bench/gguf_ckpt.py LLAMA_CPP_DIR llama OUT [HIDDEN LAYERS]   # the bench's larger model
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"
_WORDS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_REST = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# the pre_tokenizer Split regex of each family's tokenizer.json: digits in threes (Llama 3) or one by one (Qwen2)
SPLIT_PATTERNS = {"llama-bpe": _WORDS + r"\p{N}{1,3}" + _REST, "qwen2": _WORDS + r"\p{N}" + _REST}


def fetch_llama_cpp(dest: Path) -> Path:
    """llama-cpp-python's sdist from the package index, its vendored llama.cpp (the converter, its
    gguf-py, the test vocabularies) unpacked into ``dest/llama.cpp``; returns that folder."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(dest),
           f"llama-cpp-python=={LLAMA_CPP_PYTHON}"]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=900)
    sdist = dest / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    keep = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "models/ggml-vocab-")
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix) and m.name[len(prefix) :].startswith(keep)]
        for m in members:
            m.name = m.name[len(prefix) :]
        tar.extractall(dest / "llama.cpp", members=members, filter="data")
    sdist.unlink()
    return dest / "llama.cpp"


def make_tokenizer(vocab_gguf: Path, pre: str, out: Path, gguf_py: Path) -> None:
    """tokenizer.json and tokenizer_config.json in ``out`` for the vocabulary of ``vocab_gguf``
    (tokens, types, merges), pre-tokenized as the family's tokenizer.json does."""
    sys.path.insert(0, str(gguf_py))
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


def make_model(kind: str, out: Path, llama_cpp: Path, seed: int = 0, **sizes: int) -> None:
    """A tiny ``kind`` model with random bf16 weights, saved by save_pretrained in ``out`` with its
    tokenizer (make_tokenizer). Matrices have std 0.15: logits far from flat, yet a network that
    does not amplify llama.cpp's bf16 and Q8_0 activation rounding into different tokens."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(**{**CONFIGS[kind], **sizes})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.15) if p.ndim > 1 else p.uniform_(0.5, 1.5)
    model.to(torch.bfloat16).save_pretrained(out)
    vocab, pre = VOCABS[kind]
    make_tokenizer(llama_cpp / "models" / vocab, pre, out, llama_cpp / "gguf-py")


if __name__ == "__main__":
    where, kind, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    hidden, layers = (int(x) for x in sys.argv[4:6]) if len(sys.argv) > 5 else (64, 2)
    sizes = {"hidden_size": hidden, "intermediate_size": hidden * 11 // 4, "num_hidden_layers": layers,
             "num_attention_heads": max(4, hidden // 128), "num_key_value_heads": max(2, hidden // 256)}  # fmt: skip
    if kind == "qwen3":
        sizes["head_dim"] = hidden // sizes["num_attention_heads"]
    make_model(kind, out, where, **sizes)
