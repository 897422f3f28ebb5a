"""DeepSeek-V3's checkpoint layout at tiny shapes: the real names, dtypes and shard count per
tensor (FP8 weights with their ``weight_scale_inv``, 256 routed experts per MoE layer, 3 dense
layers first, an MTP layer last), every tensor a few bytes, for issue #44's count curve.

``layers=61`` is the real model: 91,991 tensors in 163 shards. Written by hand from the format
(as bench/synth.py does), not with streamck, so the input does not depend on the code
it measures.

    python bench/dsv3.py DIR --layers 61
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ITEM = {"F8_E4M3": 1, "BF16": 2, "F32": 4}
# The reference writer (safetensors' save_file, which wrote DeepSeek-V3's shards) lays a file's
# data out by dtype, widest first in its enum's order, then by name.
DTYPE_ORDER = {"F32": 0, "BF16": 1, "F8_E4M3": 2}
EXPERTS = 256
DENSE = 3  # DeepSeek-V3's first_k_dense_replace
PER_SHARD = 565  # 91,991 tensors in 163 shards
W, S = [16, 16], [1, 1]  # a weight and its scale: one 128-row tile would be the real thing's unit
ATTENTION = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
PROJS = ("gate_proj", "up_proj", "down_proj")
Entry = tuple[str, str, list[int]]  # name, dtype, shape


def _fp8(prefix: str) -> list[Entry]:
    """A quantized linear: its FP8 weight and the F32 inverse scale of each tile."""
    return [(f"{prefix}.weight", "F8_E4M3", W), (f"{prefix}.weight_scale_inv", "F32", S)]


def _layer(i: int, moe: bool) -> list[Entry]:
    """Layer ``i``'s tensors: MLA attention, norms, and a dense MLP or the routed experts,
    the shared expert and the router with its correction bias."""
    pre = f"model.layers.{i}"
    out = [t for a in ATTENTION for t in _fp8(f"{pre}.self_attn.{a}")]
    out += [(f"{pre}.self_attn.{n}.weight", "BF16", [16]) for n in ("q_a_layernorm", "kv_a_layernorm")]
    out += [(f"{pre}.{n}.weight", "BF16", [16]) for n in ("input_layernorm", "post_attention_layernorm")]
    if not moe:
        return out + [t for p in PROJS for t in _fp8(f"{pre}.mlp.{p}")]
    out += [(f"{pre}.mlp.gate.weight", "BF16", [EXPERTS, 16])]
    out += [(f"{pre}.mlp.gate.e_score_correction_bias", "F32", [EXPERTS])]
    out += [t for p in PROJS for t in _fp8(f"{pre}.mlp.shared_experts.{p}")]
    return out + [t for e in range(EXPERTS) for p in PROJS for t in _fp8(f"{pre}.mlp.experts.{e}.{p}")]


def dsv3_tensors(layers: int) -> list[Entry]:
    """Every tensor of a DeepSeek-V3 of ``layers`` decoder layers (the first 3 dense) and one MTP
    layer after them, in name order as the real index lists them."""
    out = [("model.embed_tokens.weight", "BF16", [64, 16]), ("model.norm.weight", "BF16", [16])]
    out.append(("lm_head.weight", "BF16", [64, 16]))
    for i in range(layers):
        out += _layer(i, i >= DENSE)
    mtp = f"model.layers.{layers}"
    out += _layer(layers, True)
    out += [(f"{mtp}.{n}.weight", "BF16", [16]) for n in ("enorm", "hnorm", "shared_head.norm")]
    out += [(f"{mtp}.eh_proj.weight", "BF16", [16, 32])]
    out += [(f"{mtp}.{n}.weight", "BF16", [64, 16]) for n in ("embed_tokens", "shared_head.head")]
    return sorted(out)


def config(layers: int) -> dict:
    """The config.json fields the layout depends on (the family and its expert count)."""
    return {
        "model_type": "deepseek_v3",
        "architectures": ["DeepseekV3ForCausalLM"],
        "num_hidden_layers": layers,
        "first_k_dense_replace": DENSE,
        "n_routed_experts": EXPERTS,
        "num_nextn_predict_layers": 1,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
    }


def make_dsv3(directory: Path, layers: int) -> tuple[Path, int]:
    """Write the checkpoint (shards, index, config.json) into ``directory``; it and its tensor count."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = dsv3_tensors(layers)
    shards = -(-len(tensors) // PER_SHARD)
    weight_map, total, block = {}, 0, bytes(1 << 16)
    for k in range(shards):
        name = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = tensors[k * PER_SHARD : (k + 1) * PER_SHARD]
        total += _write(directory / name, part, block)
        weight_map.update(dict.fromkeys((n for n, _, _ in part), name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    (directory / "config.json").write_text(json.dumps(config(layers)))
    return directory, len(tensors)


def _write(path: Path, part: list[Entry], block: bytes) -> int:
    """One shard of mixed dtypes (synth.write_shard takes one), in the reference writer's order."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape in sorted(part, key=lambda e: (DTYPE_ORDER[e[1]], e[0])):
        n = ITEM[dtype] * _numel(shape)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for start in range(0, offset, len(block)):
            f.write(block[: min(len(block), offset - start)])
    return offset


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=Path)
    p.add_argument("--layers", type=int, default=61)
    a = p.parse_args()
    root, count = make_dsv3(a.dir, a.layers)
    print(f"{root}: {count} tensors")


if __name__ == "__main__":
    main()
