"""The schemes ``--quantize`` takes, as data: llm-compressor 0.14.0.1's presets (compressed-tensors
0.19.0's ``quant_scheme.py``) and the ``quantization_config`` its ``model_free_ptq`` writes for each
(``QuantizationConfig.model_dump()`` under the keys ``save_utils.update_config`` adds), which is
what vLLM reads to pick its kernels."""

from __future__ import annotations

import json

from streamck.plan.compile import Plan
from streamck.storage import location

# The compressed-tensors version model_free_ptq 0.14.0.1 runs with and records ("version").
CT_VERSION = "0.19.0"


def _args(**given) -> dict:
    """One QuantizationArgs as model_dump() writes it: the defaults, then ``given``."""
    return {
        "actorder": None,
        "block_structure": None,
        "dynamic": False,
        "group_size": None,
        "num_bits": 8,
        "observer": None,
        "observer_kwargs": {},
        "scale_dtype": None,
        "strategy": "tensor",
        "symmetric": True,
        "type": "float",
        "zp_dtype": None,
        **given,
    }


# scheme -> (the weights' strategy, the compressed format, weights args, input activation args)
SCHEMES: dict[str, tuple[str, str, dict, dict | None]] = {
    "FP8_DYNAMIC": (
        "channel",
        "float-quantized",
        _args(strategy="channel"),
        _args(strategy="token", dynamic=True),
    ),
    "FP8_BLOCK": (
        "block",
        "float-quantized",
        _args(strategy="block", block_structure=[128, 128]),
        _args(strategy="group", dynamic=True, group_size=128),
    ),
    "NVFP4A16": (
        "tensor_group",
        "nvfp4-pack-quantized",
        _args(num_bits=4, strategy="tensor_group", group_size=16, scale_dtype="torch.float8_e4m3fn"),
        None,
    ),
    "MXFP4A16": (
        "group",
        "mxfp4-pack-quantized",
        _args(num_bits=4, strategy="group", group_size=32, scale_dtype="torch.uint8"),
        None,
    ),
}

# Schemes model_free_ptq runs that streamck refuses, and why (no approximation is offered).
NOT_YET: dict[str, str] = {}

# NVFP4's fused tensors, which share one global scale (llm-compressor 0.14's microscale
# DEFAULT_FUSED_MAPPINGS, the ones vLLM fuses): a primary weight's pattern, its partners' names.
# Experts are never fused: "mlp.experts.0.gate_proj" is no "mlp.gate_proj".
FUSED = (
    (r"^(?P<prefix>.+?)\.(?P<attn>attn|attention|self_attn|self_attention)\.q_proj\.weight$",
     ("{prefix}.{attn}.k_proj.weight", "{prefix}.{attn}.v_proj.weight")),
    (r"^(?P<prefix>.+?)\.(?P<attn>attn|attention|self_attn)\.wq_a\.weight$",
     ("{prefix}.{attn}.wkv_a_with_mqa.weight",)),
    (r"^(?P<prefix>.+?)\.(?P<mlp>mlp|feed_forward)\.gate_proj\.weight$", ("{prefix}.{mlp}.up_proj.weight",)),
    (r"^(?P<prefix>.+?)\.w1\.weight$", ("{prefix}.w3.weight",)),
)  # fmt: skip

# What stays in its dtype by default, as llm-compressor's examples leave it and vLLM never quantizes
# it: the output head (``--quantize-lm-head`` quantizes it), the input embeddings (added by name,
# below) and a MoE router; norms are never targets. Written first in the config's ``ignore``.
HEAD = "lm_head"
ROUTER = "re:.*mlp.gate$"
# The last part of an input embedding's module name, in transformers' models (Llama, Qwen, Mistral,
# DeepSeek, Gemma: embed_tokens; GPT-2: wte, wpe; BERT-likes: word_embeddings; GPT-NeoX: embed_in).
EMBEDDINGS = ("embed_tokens", "wte", "wpe", "word_embeddings", "tok_embeddings", "embed_in")


def quantization_config(scheme: str, ignore: list[str]) -> dict:
    """The ``quantization_config`` model_free_ptq writes into config.json for ``scheme``."""
    _, fmt, weights, inputs = SCHEMES[scheme]
    group = {
        "format": fmt,
        "input_activations": inputs,
        "output_activations": None,
        "targets": ["Linear"],
        "weights": weights,
    }
    return {
        "version": CT_VERSION,
        "quant_method": "compressed-tensors",
        "transform_config": {},
        "config_groups": {scheme: group},
        "format": fmt,
        "global_compression_ratio": None,
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "quantization_status": "compressed",
    }


def output_config(plan: Plan, beside_source: bool = False) -> dict | None:
    """The output's config.json as a dict: the one a built-in plan builds, else the copied one
    (after the rules' edits), else (``beside_source``) the source's own beside its weights; None
    when there is none or it is no JSON object."""
    data = plan.files.get("config.json", plan.side_files.get("config.json"))
    if data is None and beside_source and plan.source is not None and not plan.source.path.is_file():
        data = (plan.source.side_root or plan.source.root) / "config.json"
    if data is None:
        return None
    try:
        loaded = json.loads(data if isinstance(data, bytes) else location(data).read_bytes())
    except (OSError, ValueError):
        return None
    return loaded if isinstance(loaded, dict) else None
