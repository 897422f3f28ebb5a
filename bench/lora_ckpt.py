"""The `lora` bench's inputs and its PEFT contender, each run as a child process:

python bench/lora_ckpt.py base DIR BYTES          # a bf16 Llama of about BYTES, as save_pretrained shards it
python bench/lora_ckpt.py adapter BASE OUT [--dora]   # PEFT's get_peft_model + save_pretrained, every linear
python bench/lora_ckpt.py peft BASE ADAPTER OUT   # the usual route: load, merge_and_unload, save_pretrained
python bench/lora_ckpt.py same A B                # exit 1 unless every tensor of A and B is bit-identical
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

LAYER = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=4, vocab_size=32000)
SHARD = 512 << 20


def _names(config) -> list[tuple[str, tuple[int, ...]]]:
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    names = [("model.embed_tokens.weight", (v, h))]
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}."
        names += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
        names += [(p + f"self_attn.{x}_proj.weight", (h if x in "qo" else kv, h)) for x in "qkvo"]
        names += [(p + f"mlp.{x}_proj.weight", (h, i) if x == "down" else (i, h)) for x in ("gate", "up", "down")]
    return [*names, ("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


def make_base(out: Path, size: int) -> None:
    """Random bf16 weights, one shard (about SHARD bytes) at a time, with the index and config."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    per_layer = 2 * (2 * LAYER["hidden_size"] ** 2 * 5 // 4 + 3 * LAYER["hidden_size"] * LAYER["intermediate_size"])
    layers = max(1, (size - 4 * LAYER["vocab_size"] * LAYER["hidden_size"]) // per_layer)
    config = LlamaConfig(**LAYER, num_hidden_layers=layers, tie_word_embeddings=False, dtype="bfloat16")
    config.save_pretrained(out)
    gen = torch.Generator().manual_seed(0)
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    for name, shape in _names(config):  # shards of about SHARD bytes, planned first for their names
        if sum(2 * math.prod(s) for _, s in groups[-1]) >= SHARD:
            groups.append([])
        groups[-1].append((name, shape))
    weight_map, total = {}, 0
    for k, group in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        shard = {n: (torch.randn(s, generator=gen) * (0.02 if len(s) == 2 else 1)).to(torch.bfloat16) for n, s in group}
        save_file(shard, out / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
        total += sum(t.nbytes for t in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def make_adapter(base: Path, out: Path, dora: bool) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    peft = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", use_dora=dora))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.01)
    peft.save_pretrained(out)


def peft_merge(base: Path, adapter: Path, out: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16), adapter)
    model.merge_and_unload().save_pretrained(out)


def same(a: Path, b: Path) -> bool:
    """Every tensor of the two folders bit for bit, one tensor in memory at a time."""
    from safetensors import safe_open

    def index(d: Path) -> dict[str, Path]:
        out = {}
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(f, "pt") as s:
                out.update(dict.fromkeys(s.keys(), f))
        return out

    ia, ib = index(a), index(b)
    if sorted(ia) != sorted(ib):
        return False
    for name, fa in ia.items():
        with safe_open(fa, "pt") as sa, safe_open(ib[name], "pt") as sb:
            x, y = sa.get_tensor(name), sb.get_tensor(name)
            if x.dtype != y.dtype or not torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8)):
                print(f"differs: {name}", file=sys.stderr)
                return False
    return True


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    if cmd == "base":
        make_base(Path(args[0]), int(args[1]))
    elif cmd == "adapter":
        make_adapter(Path(args[0]), Path(args[1]), "--dora" in args)
    elif cmd == "peft":
        peft_merge(Path(args[0]), Path(args[1]), Path(args[2]))
    elif cmd == "same":
        sys.exit(0 if same(Path(args[0]), Path(args[1])) else 1)
