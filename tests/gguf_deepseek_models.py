"""DeepSeek-V3 fixtures of the GGUF tests (tests/test_gguf_deepseek.py), kept in the fixture cache
keyed by this file: tiny ``DeepseekV3ForCausalLM`` models from transformers and the reference's
conversions of them (tests/gguf_models.py's ``reference``).

- ``dsv3``: MLA with a compressed query (``q_lora_rank``), layer 0 dense (``first_k_dense_replace``),
  layer 1 MoE: 4 routed experts in 2 groups (``n_group``, ``topk_group``), a shared expert,
  sigmoid routing with ``e_score_correction_bias`` (``scoring_func: sigmoid``, as DeepSeek's own
  config.json says; transformers' config has no such key and routes by sigmoid regardless).
- ``dsv3-noq``: the same without ``q_lora_rank`` (one ``q_proj``, as DeepSeek-V2-Lite has).
- ``dsv3-yarn``: ``dsv3`` with DeepSeek-V3's YaRN RoPE.
- fp8_model: a model as DeepSeek publishes V3 in FP8 (E4M3 with 128x128 ``weight_scale_inv`` tiles,
  made here: transformers' FineGrainedFP8 leaves weights under 128 wide unquantized), a bf16 rest.

The tokenizer is llama.cpp's ``llama-bpe`` test vocabulary (bench/gguf_ckpt.py's ``make_tokenizer``):
DeepSeek's own vocabulary changes nothing the conversion does with the weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from fixture_cache import built_once, fixture_root
from gguf_models import gguf_ckpt, llama_cpp, reference  # gguf_ckpt: bench/'s builders, on the path gguf_models sets

CONFIG = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=128256, hidden_size=64,
    intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2, first_k_dense_replace=1,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=32,
    qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
    n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=2048,
    rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
    scoring_func="sigmoid", topk_method="noaux_tc",
)  # fmt: skip
# DeepSeek-V3's own RoPE (YaRN, its config.json's values), the original context cut to 64 so that a
# short prompt sees it.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip
KINDS = {"dsv3": {}, "dsv3-noq": {"q_lora_rank": None, "num_hidden_layers": 26}, "dsv3-yarn": {"rope_parameters": YARN}}


def make_model(kind: str, out: Path, seed: int = 0) -> None:
    """A tiny DeepSeek-V3 (KINDS's ``kind``) with random bf16 weights, saved by save_pretrained in
    ``out`` with the llama-bpe tokenizer. Matrices have std 0.15, vectors (norms, the routing bias)
    values in [0.5, 1.5): every weight takes part."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(**{**CONFIG, **KINDS[kind]})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.15) if p.ndim > 1 else p.uniform_(0.5, 1.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.5, 0.5)  # a bias that changes which experts are chosen
    model.to(torch.bfloat16).save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    assert config.get("scoring_func") == "sigmoid", "the config lost scoring_func"
    cpp = llama_cpp()
    gguf_ckpt.make_tokenizer(cpp / "models" / "ggml-vocab-llama-bpe.gguf", "llama-bpe", out, cpp / "gguf-py")


def tiny_model(tmp_path_factory, kind: str) -> Path:
    """The ``kind`` model's folder (named ``model``: the folder's name is ``general.name``), built
    once per machine."""
    root = fixture_root(tmp_path_factory, f"gguf-{kind}", "tests/gguf_deepseek_models.py", "bench/gguf_ckpt.py")
    return built_once(root / "model", lambda tmp: make_model(kind, tmp))


def reference_file(model: Path, outtype: str) -> Path:
    """The reference's GGUF of ``model`` as ``outtype``, kept beside it."""
    base = built_once(model.parent / f"reference-{outtype}", lambda tmp: reference(model, tmp / "model.gguf", outtype))
    return base / "model.gguf"


# DeepSeek-V3's own quantization_config (its config.json): E4M3 weights, one scale per 128x128 tile.
FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
BLOCK = 128
# What DeepSeek-V3 keeps unquantized: embeddings, lm_head, norms, the router and its bias.
FP8_KEPT = ("model.embed_tokens.weight", "lm_head.weight", "mlp.gate.weight")


def make_fp8(src: Path, out: Path, dequantized: Path) -> None:
    """``src``'s model (a tiny_model folder) as DeepSeek publishes V3 in ``out``: every other
    matrix E4M3 (``w / s`` rounded, ``s`` = a 128x128 tile's max |w| / 448, partial tiles
    included) beside ``weight_scale_inv`` (F32, the tile's ``s``), the rest as stored, and
    ``quantization_config`` in config.json; and in ``dequantized`` the same model with those
    weights as float32 ``e4m3 * s`` (what the FP8 model computes: transformers' reference)."""
    from safetensors.torch import load_file, save_file

    stored = load_file(src / "model.safetensors")
    quantized, plain = {}, {}
    for name, w in stored.items():
        if w.ndim != 2 or name.endswith(FP8_KEPT):
            quantized[name], plain[name] = w, w.float()
            continue
        q, s = _e4m3_tiles(w.float())
        quantized[name], quantized[name.removesuffix("weight") + "weight_scale_inv"] = q, s
        expand = s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[: w.shape[0], : w.shape[1]]
        plain[name] = q.float() * expand
    for folder, tensors in ((out, quantized), (dequantized, plain)):
        for f in src.iterdir():
            if f.name != "model.safetensors":
                shutil.copy(f, folder / f.name)
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": FP8_CONFIG}, indent=2))
    (dequantized / "config.json").write_text(json.dumps({**config, "dtype": "float32"}, indent=2))


def _e4m3_tiles(w):
    """``w`` [rows, cols] float32 as E4M3 values and their [ceil(rows/128), ceil(cols/128)] scales."""
    import torch

    rows, cols = w.shape
    grid = (-(-rows // BLOCK), -(-cols // BLOCK))
    padded = torch.zeros(grid[0] * BLOCK, grid[1] * BLOCK)
    padded[:rows, :cols] = w
    tiles = padded.reshape(grid[0], BLOCK, grid[1], BLOCK)
    s = tiles.abs().amax(dim=(1, 3)) / 448.0
    s = torch.where(s == 0, torch.ones_like(s), s)
    q = (tiles / s[:, None, :, None]).reshape(padded.shape)[:rows, :cols].to(torch.float8_e4m3fn)
    return q.contiguous(), s.float()


def fp8_model(tmp_path_factory, src: Path, what: str) -> tuple[Path, Path]:
    """The model of folder ``src`` (a tiny model, ``what`` its kind) as DeepSeek's FP8 layout
    (make_fp8), and its dequantized float32 twin, both in folders named ``model``, built once
    per machine."""
    code = ("tests/gguf_deepseek_models.py", "tests/gguf_models.py", "bench/gguf_ckpt.py")
    root = fixture_root(tmp_path_factory, f"gguf-{what}-fp8", *code)

    def build(tmp: Path) -> None:
        (tmp / "fp8" / "model").mkdir(parents=True)
        (tmp / "f32" / "model").mkdir(parents=True)
        make_fp8(src, tmp / "fp8" / "model", tmp / "f32" / "model")

    base = built_once(root / "layouts", build)
    return base / "fp8" / "model", base / "f32" / "model"
