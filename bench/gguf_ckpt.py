"""The GGUF case's (and the GGUF tests') models: a Llama 3 or a Qwen3 with random bf16 weights,
saved by ``save_pretrained``, with a tokenizer built by the ``tokenizers`` library from the
vocabulary and merges llama.cpp ships for its own tokenizer tests (``models/ggml-vocab-*.gguf``)
and that family's pre-tokenizer: its ids for the reference's check text are the real model's, so
``convert_hf_to_gguf.py`` recognises it (``llama-bpe``, ``qwen2``) by the hash it recognises
Meta-Llama-3 and Qwen by. The reference itself comes from the llama-cpp-python sdist (fetch_llama_cpp).

    python bench/gguf_ckpt.py LLAMA_CPP_DIR llama OUT [HIDDEN LAYERS]   # the bench's larger model
    python bench/gguf_ckpt.py LLAMA_CPP_DIR stacks OUT EXPERTS INTER    # its MoE: one layer's stacks
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
    "qwen3moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936,
                     hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                     num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, rms_norm_eps=1e-6,
                     rope_theta=1000000.0, tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645),
    "mixtral": dict(architectures=["MixtralForCausalLM"], model_type="mixtral", vocab_size=128256, hidden_size=64,
                    intermediate_size=96, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5,
                    rope_theta=1000000.0, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001),
}  # fmt: skip
CONFIGS["llama2"] = {**CONFIGS["llama"], "vocab_size": 1000, "rope_theta": 10000.0, "max_position_embeddings": 4096,
                     "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
CONFIGS["mistral"] = {**CONFIGS["llama2"], "architectures": ["MistralForCausalLM"], "model_type": "mistral",
                      "sliding_window": None}  # fmt: skip
# Llama 3.2 1B's RoPE (head_dim 64, llama3 scaling with its factors): the reference adds rope_freqs.weight.
CONFIGS["llama31"] = {**CONFIGS["llama"], "head_dim": 64, "max_position_embeddings": 131072,
                      "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192}}  # fmt: skip
SENTENCEPIECE = ("llama2", "mistral")  # kinds whose tokenizer is a tokenizer.model (make_sentencepiece)
VOCABS = {
    "llama": ("ggml-vocab-llama-bpe.gguf", "llama-bpe"),
    "llama31": ("ggml-vocab-llama-bpe.gguf", "llama-bpe"),
    "qwen3": ("ggml-vocab-qwen2.gguf", "qwen2"),
    "qwen3moe": ("ggml-vocab-qwen2.gguf", "qwen2"),
    "mixtral": ("ggml-vocab-llama-bpe.gguf", "llama-bpe"),
}


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
    if kind in SENTENCEPIECE:
        make_sentencepiece(out, CONFIGS[kind]["vocab_size"])
        return
    vocab, pre = VOCABS[kind]
    make_tokenizer(llama_cpp / "models" / vocab, pre, out, llama_cpp / "gguf-py")


_SYLLABLES = "ka lo mi ne ru ta shi po an el or ux qi be do fa gu hi jo ze".split()


def make_sentencepiece(out: Path, size: int) -> None:
    """A Llama 2 style tokenizer in ``out``: ``tokenizer.model`` trained by the ``sentencepiece``
    library (BPE, byte fallback, digits split, Llama 2's trainer settings) on made-up text from a
    seeded generator, ``size`` pieces; ``tokenizer.json`` converted from it by transformers (as
    ``AutoTokenizer`` does for a repository holding only tokenizer.model); tokenizer_config.json
    as Llama 2's (BOS added, its three special tokens in ``added_tokens_decoder``)."""
    import io
    import random
    import tempfile

    import sentencepiece as spm
    from transformers import AutoTokenizer

    rng = random.Random(0)
    words = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(800)]
    lines = [" ".join(rng.choices(words, k=rng.randint(3, 15))) + rng.choice([".", ",", "!", " 123", " 42."])
             for _ in range(4000)]  # fmt: skip
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=size, model_type="bpe", byte_fallback=True,
        character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1, split_digits=True,
        allow_whitespace_only_pieces=True, normalization_rule_name="identity", add_dummy_prefix=True,
        remove_extra_whitespaces=False, minloglevel=2,
    )  # fmt: skip
    (out / "tokenizer.model").write_bytes(model.getvalue())
    specials = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                         "special": True} for i, t in enumerate(("<unk>", "<s>", "</s>"))}  # fmt: skip
    config = {"add_bos_token": True, "add_eos_token": False, "added_tokens_decoder": specials, "bos_token": "<s>",
              "eos_token": "</s>", "unk_token": "<unk>", "legacy": False, "model_max_length": 4096,
              "tokenizer_class": "LlamaTokenizer", "clean_up_tokenization_spaces": False}  # fmt: skip
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    with tempfile.TemporaryDirectory() as tmp:
        AutoTokenizer.from_pretrained(out).save_pretrained(tmp)
        (out / "tokenizer.json").write_bytes((Path(tmp) / "tokenizer.json").read_bytes())


def make_stacks(out: Path, llama_cpp: Path, experts: int, inter: int, tokenizer_from: Path | None = None) -> None:
    """A one-layer Qwen3-MoE of ``experts`` experts of ``inter`` rows (hidden 64) in ``out``,
    written with numpy (real, varied bf16 values, no sparse file), with the qwen2 tokenizer
    (copied from ``tokenizer_from`` where given, else made): its stacked expert tensors are
    ``experts * inter * 128`` bytes each; the reference stacks each whole, in float32."""
    import shutil

    import numpy as np

    hidden, heads, kv, hd, vocab = 64, 4, 2, 16, 151936
    config = {**CONFIGS["qwen3moe"], "hidden_size": hidden, "num_hidden_layers": 1,
              "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd, "num_experts": experts,
              "moe_intermediate_size": inter, "tie_word_embeddings": True}  # fmt: skip
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    layer = {"input_layernorm": (hidden,), "post_attention_layernorm": (hidden,), "self_attn.q_norm": (hd,),
             "self_attn.k_norm": (hd,), "self_attn.q_proj": (heads * hd, hidden), "self_attn.k_proj": (kv * hd, hidden),
             "self_attn.v_proj": (kv * hd, hidden), "self_attn.o_proj": (hidden, heads * hd),
             "mlp.gate": (experts, hidden)}  # fmt: skip
    for e in range(experts):
        layer |= {f"mlp.experts.{e}.gate_proj": (inter, hidden), f"mlp.experts.{e}.up_proj": (inter, hidden),
                  f"mlp.experts.{e}.down_proj": (hidden, inter)}  # fmt: skip
    shapes |= {f"model.layers.0.{n}.weight": shape for n, shape in layer.items()}
    out.mkdir(parents=True)
    header, offset = {}, 0
    for name, shape in sorted(shapes.items()):
        size = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    values = np.random.default_rng(0).normal(0, 0.1, 1 << 21).astype(np.float32)
    block = (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()  # 4 MiB of bf16
    with open(out / "model.safetensors", "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for _ in range(offset // len(block)):
            f.write(block)
        f.write(block[: offset % len(block)])
    (out / "config.json").write_text(json.dumps(config))
    if tokenizer_from is None:
        make_tokenizer(llama_cpp / "models" / VOCABS["qwen3moe"][0], "qwen2", out, llama_cpp / "gguf-py")
    else:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer_from / name, out / name)


if __name__ == "__main__":
    where, kind, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    if kind == "stacks":
        make_stacks(out, where, int(sys.argv[4]), int(sys.argv[5]))
        sys.exit()
    hidden, layers = (int(x) for x in sys.argv[4:6]) if len(sys.argv) > 5 else (64, 2)
    sizes = {"hidden_size": hidden, "intermediate_size": hidden * 11 // 4, "num_hidden_layers": layers,
             "num_attention_heads": max(4, hidden // 128), "num_key_value_heads": max(2, hidden // 256)}  # fmt: skip
    if kind == "qwen3":
        sizes["head_dim"] = hidden // sizes["num_attention_heads"]
    make_model(kind, out, where, **sizes)
