"""The gpt-oss bench cases' model: a ``GptOssForCausalLM`` in the published MXFP4 layout
(openai/gpt-oss-20b's names, dtypes and ``quantization_config``), a layer or two of many experts
whose MXFP4 stacks are each over 256 MiB (~0.8 GiB of experts a layer, 0.12 GiB of embeddings and
head beside them, by default), written with numpy (no model is built).

The tensor names and shapes are transformers' for the config (its model made on the meta device),
the fused experts replaced as the Hub's files hold them: ``gate_up_proj_blocks`` U8
[E, 2I, H/32, 16] and ``_scales`` U8 [E, 2I, H/32], ``down_proj_blocks`` [E, H, I/32, 16] and
``_scales`` [E, H, I/32]; everything else bf16. Values are seeded random: any byte in the blocks,
E8M0 exponents 2^-5 and 2^-4 in the scales, bf16 of std 0.1 (real, varied bytes; no sparse file).
The tokenizer is the tests' llama-bpe one (bench/gguf_ckpt.py's ``make_tokenizer``), as
tests/gguf_gptoss_models.py gives its models: convert_hf_to_gguf.py recognises it by its hash.

    python bench/gptoss_ckpt.py LLAMA_CPP_DIR OUT [EXPERTS INTER HIDDEN LAYERS]   # default 128 16416 256 1
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_ckpt import make_tokenizer

# Few layers (the stacks' size, not the depth, is what the cases measure), 4 heads of 64 over 2 KV heads.
CONFIG = dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=128256, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, num_experts_per_tok=4, sliding_window=128,
              max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=128000,
              eos_token_id=128001)  # fmt: skip
# openai/gpt-oss-20b's quantization_config (its modules_to_not_convert under this model's names)
QUANT = {"quant_method": "mxfp4",
         "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                    "lm_head"]}  # fmt: skip
EXPONENTS = (127 - 5, 127 - 3)  # E8M0 scales drawn from [lo, hi): 2^-5 and 2^-4
CHUNK = 1 << 22  # bytes of each kind of random data, repeated to fill a tensor


def layout(experts: int, inter: int, hidden: int, layers: int):
    """transformers' config of the model (its ``dtype`` bf16) and every tensor's (dtype, shape) by
    name, the experts in the published MXFP4 layout; the layers alternate sliding and full attention,
    as gpt-oss's do (mlx-lm needs one of each)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    types = [("sliding_attention", "full_attention")[n % 2] for n in range(layers)]
    sizes = dict(num_local_experts=experts, intermediate_size=inter, hidden_size=hidden, num_hidden_layers=layers)
    config = AutoConfig.for_model(**CONFIG, **sizes, layer_types=types)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    shapes = {name: ("BF16", tuple(p.shape)) for name, p in model.state_dict().items()}
    groups_h, groups_i = hidden // 32, inter // 32
    for layer in range(layers):
        pre = f"model.layers.{layer}.mlp.experts."
        assert shapes.pop(pre + "gate_up_proj")[1] == (experts, hidden, 2 * inter)
        assert shapes.pop(pre + "down_proj")[1] == (experts, inter, hidden)
        shapes[pre + "gate_up_proj_blocks"] = ("U8", (experts, 2 * inter, groups_h, 16))
        shapes[pre + "gate_up_proj_scales"] = ("U8", (experts, 2 * inter, groups_h))
        shapes[pre + "down_proj_blocks"] = ("U8", (experts, hidden, groups_i, 16))
        shapes[pre + "down_proj_scales"] = ("U8", (experts, hidden, groups_i))
    return model.config, shapes


def _chunks() -> dict[str, bytes]:
    """CHUNK bytes of each kind of value: bf16 normals, block bytes, E8M0 scales."""
    import numpy as np

    rng = np.random.default_rng(0)
    values = rng.normal(0, 0.1, CHUNK // 2).astype(np.float32)
    return {
        "BF16": (values.view(np.uint32) >> 16).astype(np.uint16).tobytes(),
        "blocks": rng.integers(0, 256, CHUNK, dtype=np.uint8).tobytes(),
        "scales": rng.integers(*EXPONENTS, CHUNK, dtype=np.uint8).tobytes(),
    }


def write_safetensors(path: Path, shapes: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """``path`` holding every tensor of ``shapes`` in name order, each filled from its kind's chunk."""
    import math

    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, (dtype, shape) in sorted(shapes.items()):
        size = math.prod(shape) * (2 if dtype == "BF16" else 1)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    chunks = _chunks()
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            kind = "BF16" if entry["dtype"] == "BF16" else name.rsplit("_", 1)[-1]
            start, end = entry["data_offsets"]
            chunk = chunks[kind]
            for at in range(start, end, len(chunk)):
                f.write(chunk[: min(len(chunk), end - at)])


def make_model(
    llama_cpp: Path, out: Path, experts: int = 128, inter: int = 16416, hidden: int = 256, layers: int = 1
) -> None:
    """The model in ``out`` (made): model.safetensors, config.json and the llama-bpe tokenizer from
    llama.cpp's test vocabulary under ``llama_cpp``. ``inter`` and ``hidden`` must be multiples of
    32 (MXFP4's group); a down_proj stack is ``experts * hidden * inter / 2`` bytes of blocks."""
    if inter % 32 or hidden % 32:
        raise ValueError(f"inter {inter} and hidden {hidden} must be multiples of 32")
    config, shapes = layout(experts, inter, hidden, layers)
    out.mkdir(parents=True)
    write_safetensors(out / "model.safetensors", shapes)
    config.save_pretrained(out)  # as save_pretrained writes it, then the Hub's quantization_config
    saved = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**saved, "quantization_config": QUANT}, indent=2))
    make_tokenizer(llama_cpp / "models" / "ggml-vocab-llama-bpe.gguf", "llama-bpe", out, llama_cpp / "gguf-py")


if __name__ == "__main__":
    make_model(Path(sys.argv[1]), Path(sys.argv[2]), *(int(x) for x in sys.argv[3:7]))
