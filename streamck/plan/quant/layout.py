"""The schemes ``--quantize`` takes, as data: llm-compressor 0.14.0.1's presets (compressed-tensors
0.19.0's ``quant_scheme.py``) and the ``quantization_config`` its ``model_free_ptq`` writes for each
(``QuantizationConfig.model_dump()`` under the keys ``save_utils.update_config`` adds), which is
what vLLM reads to pick its kernels."""

from __future__ import annotations

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
}

# Schemes model_free_ptq runs that streamck refuses, and why (no approximation is offered).
NOT_YET = {
    "NVFP4A16": "not implemented yet in streamck (its FP4 rounding and fused global scale are not matched "
    "bit for bit here); use llm-compressor's model_free_ptq",
    "MXFP4A16": "not implemented yet in streamck (its E8M0 exponent rounding is not matched bit for bit here); "
    "use llm-compressor's model_free_ptq",
}

# The ignore entries users normally pass (llm-compressor's examples): the output head, and a MoE router.
USUAL_IGNORE = ("lm_head", "re:.*mlp.gate$")


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
