"""The MLX tests' models, kept in the fixture cache keyed by this file: tiny Llama, Qwen3, Qwen3-MoE
and Mixtral models (2 layers, hidden size 64 so that MLX's groups of 32, 64 and 128 each fit some
matrices; random bf16 weights) with a small byte-level BPE tokenizer, and mlx_lm.convert's folders
for them (the references, made once per machine by tests/mlx_driver.py in the mlx venv).

- Dense models: ``save_pretrained``; the Llama one also holds a ``rotary_emb.inv_freq`` tensor,
  as older Llama checkpoints do (mlx-lm's sanitize drops it).
- MoE models (tests/moe_models.py's configs, widened): ``hf/`` by ``save_pretrained`` (per expert)
  and ``fused/`` as a trainer's ``model.state_dict()`` (transformers 5's fused
  ``experts.gate_up_proj``). Qwen3-MoE's config.json also holds ``num_experts`` and ``rope_theta``,
  as the Hub's Qwen3-MoE configs do (transformers 5.19 saves neither; mlx-lm 0.32.2 needs both).
"""

from __future__ import annotations

import json
from pathlib import Path

from fixture_cache import built_once, fixture_root

DENSE_KINDS = ("llama", "qwen3")
MOE_KINDS = ("qwen3_moe", "mixtral")
VOCAB = 320  # the byte tokens and two specials, and spare rows
WIDE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_hidden_layers=2,
    vocab_size=VOCAB,
    bos_token_id=256,
    eos_token_id=257,
    pad_token_id=None,
)
CODE = ("tests/mlx_models.py", "tests/moe_models.py")


def model_folder(tmp_path_factory, kind: str) -> Path:
    """The tiny ``kind`` model's folder (a MoE's: its ``hf`` and ``fused`` saves inside), built once per machine."""
    root = fixture_root(tmp_path_factory, f"mlx-{kind}", *CODE)
    return built_once(root / "model", lambda tmp: make_model(kind, tmp))


def make_tokenizer(out: Path) -> None:
    """A byte-level BPE tokenizer of the 256 bytes (no merges) with BOS and EOS, saved as
    tokenizer.json and tokenizer_config.json (with a chat template)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=lambda c: ord(c)))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|bos|>", special=True), AddedToken("<|eos|>", special=True)])
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "chat_template": "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def make_model(kind: str, out: Path) -> None:
    """``kind``'s tiny model (every weight perturbed, so no two experts are alike) in bf16, with the tokenizer."""
    import torch
    from moe_models import model_class, runtime_save, tiny_config

    torch.manual_seed(1)
    extra = {"moe_intermediate_size": 64} if kind == "qwen3_moe" else {}
    extra |= {"tie_word_embeddings": kind == "qwen3"}
    config = tiny_config(kind, **WIDE, **extra)
    model = model_class(config)(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model = model.to(torch.bfloat16)
    folders = [out / "hf", out / "fused"] if kind in MOE_KINDS else [out]
    model.save_pretrained(folders[0])
    if len(folders) > 1:
        runtime_save(model, folders[1])
        model.generation_config.save_pretrained(folders[1])  # kept beside a trainer's save as beside save_pretrained's
    for folder in folders:
        make_tokenizer(folder)
        if kind == "qwen3_moe":  # the keys the Hub's Qwen3-MoE configs hold, which mlx-lm's ModelArgs needs
            path = folder / "config.json"
            saved = json.loads(path.read_text())
            saved |= {"num_experts": config.num_local_experts, "rope_theta": saved["rope_parameters"]["rope_theta"]}
            path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    if kind == "llama":
        _add_inv_freq(out / "model.safetensors", config)


def _add_inv_freq(path: Path, config) -> None:
    """Add layer 0's ``self_attn.rotary_emb.inv_freq`` (float32), as transformers 4.3x and older saved it."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    half = config.head_dim // 2
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = 1.0 / (10000.0 ** (torch.arange(half) / half))
    save_file(tensors, path, metadata={"format": "pt"})


SHARD = 64 << 10  # a shard size the tiny Llama is cut at, several times (mlx_lm's own is 5 GiB)
# mlx_lm.convert's folders the tests compare with: name -> (model, convert()'s arguments). A MoE's
# reference is converted from its per-expert save (mlx-lm's sanitize reads no fused experts).
REFERENCES = {
    "llama": ("llama", {}),
    "llama-f16": ("llama", {"dtype": "float16"}),
    "llama-f32": ("llama", {"dtype": "float32"}),
    "llama-q4": ("llama", {"quantize": True}),
    "llama-q8": ("llama", {"quantize": True, "q_bits": 8}),
    "llama-q4-g32-f32": ("llama", {"quantize": True, "q_group_size": 32, "dtype": "float32"}),
    "llama-shards": ("llama", {"shard_bytes": SHARD}),
    "qwen3": ("qwen3", {}),
    "qwen3-q4": ("qwen3", {"quantize": True}),
    "qwen3-q8-g128": ("qwen3", {"quantize": True, "q_bits": 8, "q_group_size": 128}),
    "llama-mxfp4": ("llama", {"quantize": True, "q_mode": "mxfp4"}),
    "qwen3_moe-mxfp4": ("qwen3_moe/hf", {"quantize": True, "q_mode": "mxfp4"}),
    "llama-nvfp4": ("llama", {"quantize": True, "q_mode": "nvfp4"}),
    "llama-mxfp8": ("llama", {"quantize": True, "q_mode": "mxfp8"}),
    "llama-nvfp4-f16": ("llama", {"quantize": True, "q_mode": "nvfp4", "dtype": "float16"}),
    "qwen3_moe-mxfp8": ("qwen3_moe/hf", {"quantize": True, "q_mode": "mxfp8"}),
    **{k: (f"{k}/hf", {}) for k in MOE_KINDS},
    **{f"{k}-q4": (f"{k}/hf", {"quantize": True}) for k in MOE_KINDS},
}


def source(models: dict[str, Path], model: str) -> Path:
    """The folder of ``model`` (``kind`` or ``kind/hf``, ``kind/fused``) among ``models`` by kind."""
    kind, _, how = model.partition("/")
    return models[kind] / how if how else models[kind]


def references(tmp_path_factory, models: dict[str, Path]) -> Path:
    """The folder holding every REFERENCES folder by name, converted once per machine (one child)."""
    from mlx_env import run_jobs

    root = fixture_root(tmp_path_factory, "mlx-refs", *CODE, "tests/mlx_env.py", "tests/mlx_driver.py")

    def build(tmp: Path) -> None:
        jobs = [
            {"op": "convert", "src": str(source(models, model)), "dst": str(tmp / name), **convert}
            for name, (model, convert) in REFERENCES.items()
        ]
        errors = [a["error"] for a in run_jobs(jobs) if "error" in a]
        assert not errors, errors

    return built_once(root / "refs", build)
