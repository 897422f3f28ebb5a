"""The Hugging Face config of a Megatron GPTModel written from its run's ``args`` alone (no
``--hf-config``): every value as Megatron-LM 0.19 records it (the norm epsilon in
``layernorm_epsilon``, the RoPE base in ``rotary_base``, the query groups, the head tying, the
vocabulary at ``args.vocab_size`` rows of the padded ``padded_vocab_size``, SwiGLU as ``silu``)."""

from __future__ import annotations

from streamck.plan.megatron.layout import HF_DEFAULT, HF_MODELS, NORM_EPSILON


def norm_epsilon(args: dict) -> float:
    """The norm epsilon as Megatron-LM saved it (NORM_EPSILON: 0.19 keeps it in ``layernorm_epsilon``),
    else its default."""
    return next((args[k] for k in NORM_EPSILON if args.get(k) is not None), 1e-5)


def args_config(args: dict, s: dict[str, int], bias: bool, norms: bool, tied: bool) -> dict:
    """The Hugging Face config of the model, from Megatron's args (no --hf-config given)."""
    arch, model_type = next((HF_MODELS[k] for k, on in (("qk_layernorm", norms), ("add_qkv_bias", bias)) if on),
                            HF_DEFAULT)  # fmt: skip
    theta = args.get("rotary_base", 10000)
    config = {
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": s["H"],
        "intermediate_size": s["I"],
        "num_attention_heads": s["nh"],
        "num_key_value_heads": s["nkv"],
        "head_dim": s["d"],
        "num_hidden_layers": s["L"],
        "vocab_size": s["V"],
        "hidden_act": "silu",
        "rms_norm_eps": norm_epsilon(args),
        "max_position_embeddings": args.get("max_position_embeddings") or args.get("seq_length") or 4096,
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "tie_word_embeddings": tied,
    }
    if model_type == "llama":
        config["attention_bias"] = bias
    return config
