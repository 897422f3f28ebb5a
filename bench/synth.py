"""Build a synthetic Llama-shaped sharded safetensors checkpoint, shard by shard.

Written by hand from the format (8-byte length, JSON header, data), not with
streamck, so the benchmark's input does not depend on the code it measures.
Memory stays at one 16 MiB block of random bytes, reused.

    python bench/synth.py DIR --size 4GiB --embed 1GiB --dtype F32 --shard 1GiB
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
from pathlib import Path

import numpy as np

from streamck.writer import parse_size

ITEM = {"F32": 4, "BF16": 2, "F16": 2}
BLOCK = 16 << 20


def llama_tensors(size: int, embed: int, dtype: str) -> list[tuple[str, list[int]]]:
    """Names and shapes: one [V, H] embedding of about ``embed`` bytes, then layers until ``size``."""
    item = ITEM[dtype]
    hidden = 2048 if size >= 1 << 30 else 256
    inter = hidden * 11 // 4
    vocab = max(1, embed // (hidden * item))
    tensors = [("model.embed_tokens.weight", [vocab, hidden]), ("model.norm.weight", [hidden])]
    total = (vocab + 1) * hidden * item
    layer = [
        ("self_attn.q_proj.weight", [hidden, hidden]),
        ("self_attn.k_proj.weight", [hidden // 4, hidden]),
        ("self_attn.v_proj.weight", [hidden // 4, hidden]),
        ("self_attn.o_proj.weight", [hidden, hidden]),
        ("mlp.gate_proj.weight", [inter, hidden]),
        ("mlp.up_proj.weight", [inter, hidden]),
        ("mlp.down_proj.weight", [hidden, inter]),
        ("input_layernorm.weight", [hidden]),
        ("post_attention_layernorm.weight", [hidden]),
        ("self_attn.rotary_emb.inv_freq", [hidden // 32]),
    ]
    per_layer = sum(int(np.prod(s)) for _, s in layer) * item
    for i in range(max(1, -(-(size - total) // per_layer))):  # round up: at least `size`
        tensors += [(f"model.layers.{i}.{n}", s) for n, s in layer]
    return tensors


def write_shard(path: Path, entries: list[tuple[str, list[int]]], dtype: str, block: bytes) -> int:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in entries:
        n = int(np.prod(shape)) * ITEM[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        left = offset
        while left:
            f.write(block[: min(left, len(block))])
            left -= min(left, len(block))
    return offset


def make_checkpoint(directory: Path, size: int, embed: int, dtype: str = "F32", shard: int = 1 << 30) -> Path:
    """Write the checkpoint into ``directory`` (created) with a weight_map index."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = llama_tensors(size, embed, dtype)
    groups: list[list[tuple[str, list[int]]]] = [[]]
    used = 0
    for name, shape in tensors:
        n = int(np.prod(shape)) * ITEM[dtype]
        if groups[-1] and used + n > shard:
            groups.append([])
            used = 0
        groups[-1].append((name, shape))
        used += n
    # Finite random values, so casts do real work and no page is all zeros.
    rng = np.random.default_rng(0)
    block = rng.standard_normal(BLOCK // 4, dtype=np.float32)
    if dtype != "F32":
        block = block.astype(np.float16)  # any 2-byte pattern of finite values will do
    raw = block.tobytes()
    weight_map, total = {}, 0
    for i, group in enumerate(groups, 1):
        name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        total += write_shard(directory / name, group, dtype, raw)
        weight_map.update(dict.fromkeys((n for n, _ in group), name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    os.sync()
    return directory


def make_bin(path: Path, size: int, embed: int) -> Path:
    """A torch.save zip checkpoint shaped like synth's: one large embedding, then layers."""
    import torch

    state = {}
    for name, shape in llama_tensors(size, embed, "F32"):
        state[name] = torch.empty(shape).normal_()
    torch.save(state, path)
    os.sync()
    return path


# The training config of an EAGLE-4 draft, as the trainer writes it (sizes set below).
DRAFT_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_hidden_layers": 32,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 39, 76]},
}


def make_eagle4_draft(root: Path, scale: int) -> Path:
    """A trained EAGLE-4 draft for a 70B target (H=8192, I=28672, V=128256, T=8192, A=3,
    R=1024), every size divided by ``scale``, written as a step directory."""
    from streamck.plan.eagle4.plan import training_shapes

    H, I, V, R = 8192 // scale, 28672 // scale, 128256 // scale, 1024 // scale  # noqa: E741
    config = {
        **DRAFT_CONFIG,
        "hidden_size": H,
        "intermediate_size": I,
        "vocab_size": V,
        "efficient_lm_head_rank": R,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": H // 64,
        "target_hidden_size": H,
    }
    directory = root / "model" / "consolidated"
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    block = os.urandom(16 << 20)
    write_shard(
        directory / "model.safetensors", [(n, list(s)) for n, s in training_shapes(config).items()], "BF16", block
    )
    os.sync()
    return root


def make_many_shards(root: Path, shards: int, per: int) -> Path:
    root.mkdir()
    weight_map = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        header = {"__metadata__": {"format": "pt"}}
        for t in range(per):
            key = f"model.layers.{s}.block.{t}.weight"
            header[key] = {"dtype": "BF16", "shape": [2, 2], "data_offsets": [8 * t, 8 * t + 8]}
            weight_map[key] = name
        raw = json.dumps(header, separators=(",", ":")).encode()
        (root / name).write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(8 * per))
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return root


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=Path)
    p.add_argument("--size", default="4GiB")
    p.add_argument("--embed", default="1GiB")
    p.add_argument("--dtype", default="F32", choices=sorted(ITEM))
    p.add_argument("--shard", default="1GiB")
    a = p.parse_args()
    make_checkpoint(a.dir, parse_size(a.size), parse_size(a.embed), a.dtype, parse_size(a.shard))
    print(f"wrote {a.dir}", file=sys.stderr)


if __name__ == "__main__":
    main()
