"""The producers and oracles of the dequantize tests (tests/test_dequantize*.py) beyond
tests/quant_oracles.py's, run in a child (transformers' and llm-compressor's imports are heavy):

    gptoss OUT                 a tiny gpt-oss saved by transformers (save_pretrained, bf16), its experts
                               stored as the published checkpoints store them (openai/gpt-oss-20b's names,
                               shapes and quantization_config): ``experts.gate_up_proj_blocks`` U8
                               [E, 2I, H/32, 16] with ``_scales`` U8 [E, 2I, H/32] (E8M0), ``down_proj_blocks``
                               [E, H, I/32, 16] with ``_scales`` [E, H, I/32]
    gptoss_logits OURS SRC     OURS loads in transformers with every key, its logits those of SRC's load
    gptoss_load SRC DTYPE OUT  transformers' own load with Mxfp4Config(dequantize=True) on the CPU: the
                               model's state_dict, saved (see gptoss_load for why not save_pretrained)
    base128 OUT                a tiny Llama whose projections are 128 columns wide or less (bf16)
    ue8m0 SRC OUT              transformers' FineGrainedFP8 with scale_fmt="ue8m0" (E8M0 scales)
    relabel SRC OUT            model_free_ptq's FP8_BLOCK output in FineGrainedFP8's names (see relabel)
    decompress SRC DTYPE OUT   compressed-tensors' own decompressor on each FP8 module of SRC, the weight cast
    fp8_ops SRC DTYPE OUT      transformers' Fp8Dequantize on each FP8 weight of SRC whose 128-tiles are whole

No MXFP4 writer runs on a CPU here: transformers' Mxfp4Quantize calls triton_kernels (downloaded from
the kernels hub at run time, CUDA only) and OpenAI's gpt-oss package ships readers only. So the
experts' bytes are drawn over the format's whole domain: every byte value in the blocks (each nibble
one of the 16 E2M1 codes, -0 included) and E8M0 exponents 2^-10..2^+5 (the published experts' range),
in the producer's layout; transformers' load is the oracle for every one of them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

CONFIG = dict(hidden_size=128, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, num_local_experts=4, num_experts_per_tok=2, vocab_size=256,
              layer_types=["sliding_attention", "full_attention"], sliding_window=16)  # fmt: skip
# openai/gpt-oss-20b's quantization_config (its modules_to_not_convert under this model's names)
QUANT = {"quant_method": "mxfp4",
         "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                    "lm_head"]}  # fmt: skip


def _mxfp4(g: torch.Generator, experts: int, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks [E, rows, cols/32, 16] and E8M0 scales [E, rows, cols/32] for a weight stored [E, rows, cols]."""
    blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
    blocks.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)  # every byte value at least once
    scales = torch.randint(127 - 10, 127 + 6, (experts, rows, cols // 32), generator=g, dtype=torch.uint8)
    return blocks, scales


def gptoss(out: str) -> None:
    from safetensors.torch import load_file, save_file
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    config = GptOssConfig(**CONFIG)
    GptOssForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    path = Path(out) / "model.safetensors"
    tensors = load_file(path)
    g = torch.Generator().manual_seed(1)
    e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
    for layer in range(config.num_hidden_layers):
        pre = f"model.layers.{layer}.mlp.experts."
        assert tensors.pop(pre + "gate_up_proj").shape == (e, h, 2 * i)
        assert tensors.pop(pre + "down_proj").shape == (e, i, h)
        tensors[pre + "gate_up_proj_blocks"], tensors[pre + "gate_up_proj_scales"] = _mxfp4(g, e, 2 * i, h)
        tensors[pre + "down_proj_blocks"], tensors[pre + "down_proj_scales"] = _mxfp4(g, e, h, i)
    save_file(tensors, path, metadata={"format": "pt"})
    cfg = json.loads((Path(out) / "config.json").read_text())
    (Path(out) / "config.json").write_text(json.dumps({**cfg, "quantization_config": QUANT}, indent=2))


def gptoss_load(src: str, dtype: str, out: str) -> None:
    """The dequantized model's tensors. Its save_pretrained is not used: transformers 5.19 writes the
    dequantized experts under its converter's regular expressions (``gate_up_proj$``, ``down_proj$``, one
    of each for the whole model) instead of each layer's names, so that file cannot be the oracle."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, Mxfp4Config

    model = AutoModelForCausalLM.from_pretrained(
        src, quantization_config=Mxfp4Config(dequantize=True), dtype=getattr(torch, dtype)
    )
    assert getattr(model.config, "quantization_config", None) is None
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, out)


def gptoss_logits(ours: str, src: str) -> None:
    """OURS (a dequantized folder) loads in transformers with no missing or unexpected keys, and its
    logits equal those of SRC loaded with Mxfp4Config(dequantize=True); exits non-zero otherwise."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    model, info = AutoModelForCausalLM.from_pretrained(ours, dtype=torch.bfloat16, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    oracle = AutoModelForCausalLM.from_pretrained(
        src, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.bfloat16
    )
    tokens = torch.arange(3, 40).reshape(1, -1)
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, oracle(tokens).logits)


def base128(out: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=256, tie_word_embeddings=False)  # fmt: skip
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)


def ue8m0(src: str, out: str) -> None:
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config
    from transformers.quantizers import quantizer_finegrained_fp8

    # Patched: the quantizer refuses to run without a GPU; its quantization itself runs on the CPU.
    quantizer_finegrained_fp8.FineGrainedFP8HfQuantizer.validate_environment = lambda self, *a, **k: None
    config = FineGrainedFP8Config(weight_block_size=(128, 128), scale_fmt="ue8m0")
    AutoModelForCausalLM.from_pretrained(src, quantization_config=config, dtype=torch.bfloat16).save_pretrained(out)


def relabel(src: str, out: str) -> None:
    """A FineGrainedFP8 checkpoint with partial 128-tiles (and per-expert MoE weights) from model_free_ptq's
    FP8_BLOCK output: the same E4M3 weights and 128×128 tile scales (BF16, dequantized the same way,
    q × s), ``weight_scale`` named ``weight_scale_inv`` and the config's quant_method fp8. transformers'
    FineGrainedFP8 writes no partial tiles (it leaves such weights unquantized), and its per-expert save
    writes each expert's scale cut wrong (a [2] vector for a [1, 2] grid), so neither can make these."""
    import shutil

    from safetensors.torch import load_file, save_file

    def renamed(k: str) -> str:
        return k + "_inv" if k.endswith(".weight_scale") else k

    shutil.copytree(src, out)
    for path in Path(out).glob("*.safetensors"):
        save_file({renamed(k): v for k, v in load_file(path).items()}, path, metadata={"format": "pt"})
    for path in Path(out).glob("*.index.json"):
        index = json.loads(path.read_text())
        index["weight_map"] = {renamed(k): v for k, v in index["weight_map"].items()}
        path.write_text(json.dumps(index, indent=2))
    cfg = json.loads((Path(out) / "config.json").read_text())
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    (Path(out) / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}, indent=2))


def _stored(src: str) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(Path(src).glob("*.safetensors")) for k, v in load_file(f).items()}


def decompress(src: str, dtype: str, out: str) -> None:
    """compressed-tensors' FloatQuantizationCompressor.decompress on each ``weight`` + ``weight_scale``
    module of SRC, with the scheme of its config (the strategy and block from there), the weight cast."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import save_file

    qc = json.loads((Path(src) / "config.json").read_text())["quantization_config"]
    (group,) = qc["config_groups"].values()
    scheme = QuantizationScheme(**group)
    compressor = BaseCompressor.get_value_from_registry(group.get("format") or qc["format"])
    stored, weights = _stored(src), {}
    for name in stored:
        if name.endswith(".weight_scale"):
            module = name.rpartition(".")[0]
            local = {"weight": stored[f"{module}.weight"], "weight_scale": stored[name]}
            weights[f"{module}.weight"] = compressor.decompress(local, scheme)["weight"].to(getattr(torch, dtype))
    save_file({k: v.contiguous() for k, v in weights.items()}, out)


def fp8_ops(src: str, dtype: str, out: str) -> None:
    """transformers' own Fp8Dequantize._dequantize_one on each FP8 weight of SRC whose 128-tiles are whole
    (there its tile, rows ÷ scale rows, is the block's); the others are left out."""
    from safetensors.torch import save_file
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    stored, op, weights = _stored(src), Fp8Dequantize(None), {}
    for name, scale in stored.items():
        if name.endswith(".weight_scale_inv"):
            weight = stored[name.removesuffix("_scale_inv")]
            if weight.shape[-1] % 128 == 0 and weight.shape[-2] % 128 == 0:
                weights[name.removesuffix("_scale_inv")] = op._dequantize_one(weight, scale, getattr(torch, dtype))
    save_file({k: v.contiguous() for k, v in weights.items()}, out)


COMMANDS = {f.__name__: f for f in (gptoss, gptoss_load, gptoss_logits, base128, ue8m0, relabel, decompress, fp8_ops)}

if __name__ == "__main__":
    COMMANDS[sys.argv[1]](*sys.argv[2:])
