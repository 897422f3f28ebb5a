"""The producers and oracles tests/test_quantize.py and test_dequantize.py compare against, run in a
child (llm-compressor's import alone is ~0.5 GiB and installs loggers):

    bases OUT                  tiny Llama (one file, two shardings, 128-wide, tied) and Qwen3-MoE, bf16, by transformers
    ptq SRC OUT SCHEME [IGN..] llm-compressor 0.14.0.1's model_free_ptq on the CPU
    fp8 SRC OUT                a DeepSeek-V3-layout FP8 checkpoint, by transformers' FineGrainedFP8
    load SRC DTYPE OUT         the weights transformers loads from a quantized SRC (dequantizing), saved
    decompress SRC DTYPE OUT   compressed-tensors' own decompressor on each quantized module of SRC, saved
"""

from __future__ import annotations

import sys

import torch


def bases(out: str) -> None:
    from pathlib import Path

    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    # 320 is no multiple of 128: FP8_BLOCK pads the last tiles (rows of gate/up, columns of down).
    llama = LlamaConfig(hidden_size=256, intermediate_size=320, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False)  # fmt: skip
    model = LlamaForCausalLM(llama).to(torch.bfloat16)
    with torch.no_grad():  # a zero row and a zero tile: their scales are the dtype's epsilon
        model.model.layers[0].self_attn.o_proj.weight[:128, :128] = 0
        # FP4's edges: a row of groups whose max is 6, so that NVFP4's scale over the global one is
        # exactly 1 (global 2688/6 = 448, group 448 * 6/6) and MXFP4's is 2^0: each rounding tie of
        # E2M1 (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5), -0, a negative that rounds to zero.
        edges = [6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.1, -0.0, 0.0, -5.0, -2.5, 0.5, -1.75]
        model.model.layers[0].self_attn.q_proj.weight[0] = torch.tensor(edges * 16)
        model.model.layers[1].self_attn.o_proj.weight.zero_()  # NVFP4: an all-zero tensor's global scale is 1
    model.save_pretrained(f"{out}/llama")
    model.save_pretrained(f"{out}/llama-sharded", max_shard_size="600KB")
    # q, k and v of each layer in three files, gate and up in two: NVFP4's global scale crosses files.
    model.save_pretrained(f"{out}/llama-split", max_shard_size="300KB")
    # transformers' FP8 dequantizer refuses a shape that is no multiple of its scale grid: this one is.
    LlamaForCausalLM(llama.__class__(**{**llama.to_dict(), "intermediate_size": 384})).to(
        torch.bfloat16
    ).save_pretrained(f"{out}/llama384")
    # Tied embeddings (no lm_head.weight stored), every side a multiple of 128 (loads as served).
    LlamaForCausalLM(llama.__class__(**{**llama.to_dict(), "intermediate_size": 384, "tie_word_embeddings": True})).to(
        torch.bfloat16
    ).save_pretrained(f"{out}/llama-tied")
    # NaN and ±inf among the weights, a whole FP4 group of them too: compressed-tensors' bytes for them.
    from safetensors.torch import save_file

    up, down = torch.randn(256, 256), torch.randn(256, 256)
    nan, inf = float("nan"), float("inf")
    up[0, 5], up[1, 7], up[202, 40], down[5, 9] = nan, -nan, nan, nan
    up[130, 3], up[140, 200], up[200, :16], up[201, :32] = inf, -inf, inf, -inf
    up[203, 64:96], up[203, 70] = 0.0, -0.0
    Path(f"{out}/nan").mkdir()
    layer = "model.layers.0.mlp"
    save_file({f"{layer}.up_proj.weight": up.to(torch.bfloat16), f"{layer}.down_proj.weight": down.to(torch.bfloat16)},
              f"{out}/nan/model.safetensors", metadata={"format": "pt"})  # fmt: skip
    Path(f"{out}/nan/config.json").write_text('{"model_type": "llama", "dtype": "bfloat16"}')
    moe = Qwen3MoeConfig(hidden_size=256, intermediate_size=384, moe_intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=512, num_experts=4,
                         num_experts_per_tok=2, tie_word_embeddings=False)  # fmt: skip
    Qwen3MoeForCausalLM(moe).to(torch.bfloat16).save_pretrained(f"{out}/qwen3moe")


def ptq(src: str, out: str, scheme: str, *ignore: str) -> None:
    import safetensors.torch
    from llmcompressor.entrypoints import model_free as mf

    save = safetensors.torch.save_file
    # Patched: FP8_BLOCK truncates a padded tile column with a slice, and save_file refuses the
    # non-contiguous tensor (model_free_ptq crashes on any width that is no multiple of 128).
    # The bytes are the slice's; only their layout in memory is made contiguous.
    mf.save_file = lambda tensors, path, **kw: save({k: v.contiguous() for k, v in tensors.items()}, path, **kw)
    mf.model_free_ptq(src, out, scheme=scheme, ignore=list(ignore), device="cpu")


def fp8(src: str, out: str) -> None:
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config
    from transformers.quantizers import quantizer_finegrained_fp8

    # Patched: the quantizer refuses to run without a GPU; its quantization itself runs on the CPU.
    quantizer_finegrained_fp8.FineGrainedFP8HfQuantizer.validate_environment = lambda self, *a, **k: None
    config = FineGrainedFP8Config(weight_block_size=(128, 128))
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=config, dtype=torch.bfloat16)
    model.save_pretrained(out)


def load(src: str, dtype: str, out: str) -> None:
    import json

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig, FineGrainedFP8Config
    from transformers.quantizers import quantizer_finegrained_fp8

    quantizer_finegrained_fp8.FineGrainedFP8HfQuantizer.validate_environment = lambda self, *a, **k: None
    method = json.load(open(f"{src}/config.json"))["quantization_config"]["quant_method"]
    config = FineGrainedFP8Config(dequantize=True) if method == "fp8" else CompressedTensorsConfig(run_compressed=False)
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=config, dtype=getattr(torch, dtype))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, out)


def decompress(src: str, dtype: str, out: str) -> None:
    """Each quantized module's tensors as SRC stores them, through the compressor its config's format
    names (NVFP4PackedCompressor / MXFP4PackedCompressor.decompress, what ModelCompressor.decompress_model
    runs per module), the weight then cast to DTYPE; the other tensors are left out."""
    import json
    from pathlib import Path

    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file, save_file

    qc = json.loads((Path(src) / "config.json").read_text())["quantization_config"]
    (group,) = qc["config_groups"].values()
    scheme = QuantizationScheme(**group)
    compressor = BaseCompressor.get_value_from_registry(group.get("format") or qc["format"])
    stored = {k: v for f in sorted(Path(src).glob("*.safetensors")) for k, v in load_file(f).items()}
    weights = {}
    for name in stored:
        if name.endswith(".weight_packed"):
            module = name.rpartition(".")[0]
            local = {k.rpartition(".")[2]: v for k, v in stored.items() if k.rpartition(".")[0] == module}
            weights[f"{module}.weight"] = compressor.decompress(local, scheme)["weight"].to(getattr(torch, dtype))
    save_file({k: v.contiguous() for k, v in weights.items()}, out)


if __name__ == "__main__":
    {"bases": bases, "ptq": ptq, "fp8": fp8, "load": load, "decompress": decompress}[sys.argv[1]](*sys.argv[2:])
