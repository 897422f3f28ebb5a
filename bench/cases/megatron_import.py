"""--format megatron: a Hugging Face Llama to a Megatron ``torch_dist`` run root, against cp -r of
the model: time and peak RSS. Megatron-Bridge's import (the reference) does not install here (its
0.3 needs Transformer Engine and transformers < 5, 0.6 Python >= 3.12), so it is not a contender."""

from __future__ import annotations

import argparse
import json
import os
import struct
from pathlib import Path

from harness import case, contend, cp_fsync, dir_bytes, mib, parse_size, peak_at, streamck, table

# A Llama 3-shaped model whose embedding and head are each over 256 MiB (vocab 128256 x hidden, F32).
LAYERS, HEADS, GROUPS, HEAD_DIM, FFN, VOCAB = 2, 8, 4, 128, 2816, 128256


def _tensors(hidden: int) -> dict[str, tuple[int, ...]]:
    q, kv = HEADS * HEAD_DIM, GROUPS * HEAD_DIM
    out = {
        "model.embed_tokens.weight": (VOCAB, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (VOCAB, hidden),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                p + "self_attn.q_proj.weight": (q, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
                p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, q),
                p + "mlp.gate_proj.weight": (FFN, hidden), p + "mlp.up_proj.weight": (FFN, hidden),
                p + "mlp.down_proj.weight": (hidden, FFN)}  # fmt: skip
    return out


def make_model(folder: Path, hidden: int) -> None:
    """config.json and one model.safetensors of random F32 values, written a MiB at a time."""
    folder.mkdir(parents=True)
    shapes, header, at = _tensors(hidden), {}, 0
    for name, shape in shapes.items():
        n = 4
        for d in shape:
            n *= d
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        left = at
        while left:
            piece = min(left, 1 << 20)
            f.write(os.urandom(piece // 4 * 4)[:piece])  # finite or not, the bytes are only moved
            left -= piece
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": FFN, "num_attention_heads": HEADS, "num_key_value_heads": GROUPS,
              "head_dim": HEAD_DIM, "num_hidden_layers": LAYERS, "vocab_size": VOCAB, "rms_norm_eps": 1e-5,
              "rope_theta": 500000.0, "tie_word_embeddings": False, "hidden_act": "silu"}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))


@case(size="1GiB")
def case_megatron_import(a: argparse.Namespace, tmp: Path) -> str:
    """A Llama (F32; its embedding and head over 256 MiB each) to Megatron torch_dist vs cp -r + sync;
    peak RSS also on a model a quarter the size (it must not grow with the tensors)."""
    hidden = max(256, parse_size(a.size) // (2 * VOCAB * 4) // 128 * 128)
    base, small = tmp / "llama", tmp / "llama-small"
    make_model(base, hidden)
    make_model(small, max(128, hidden // 4 // 128 * 128))

    def ours(src: Path, *flags: str):
        return lambda o: streamck("rewrite", str(src), "-o", str(o), "--format", "megatron", "-q", *flags)

    contenders = {"cp -r + sync (model)": cp_fsync(base), "streamck --format megatron": ours(base),
                  "streamck --format megatron --dtype bf16": ours(base, "--dtype", "bf16")}  # fmt: skip
    runs = contend(contenders, tmp / "out", a.reps, a.settle, (base,))
    small_peak = peak_at(ours(small)(tmp / "out-small"), tmp / "out-small", a.settle)
    small_cast = peak_at(ours(small, "--dtype", "bf16")(tmp / "out-small"), tmp / "out-small", a.settle)
    biggest = VOCAB * hidden * 4
    return (
        f"Model: a Llama of hidden {hidden}, {LAYERS} layers, vocab {VOCAB}, untied head, F32: "
        f"{dir_bytes(base) / 2**30:.2f} GiB, its embedding and head {biggest / 2**20:.0f} MiB each. "
        f"{a.reps} interleaved reps, {a.settle:.0f} s settle. Peak RSS at a quarter the hidden size: "
        f"{mib(small_peak)} (bf16: {mib(small_cast)}). Megatron-Bridge's import does not install here "
        "(0.3: Transformer Engine and transformers < 5; 0.6: Python >= 3.12).\n\n"
        + table(runs, "cp -r + sync (model)", dir_bytes(base))
    )
