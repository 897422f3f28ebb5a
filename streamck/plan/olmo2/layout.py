"""OLMo-core's OLMo 2 parameter names against Hugging Face's ``Olmo2ForCausalLM``, as data.

Each row (streamck.plan.contract.Row): Hugging Face name (``out``), OLMo-core name (``src``),
and its shape in the config's symbols (streamck.plan.hf_export.SYMBOLS); ``{i}`` is the layer
index. Source: OLMo-core 3.0.0
``olmo_core/nn/hf/convert.py`` (``OLMO_CORE_TO_HF_WEIGHT_MAPPINGS``): OLMo 2's blocks are
"reordered norm" blocks, whose norms come after attention and feed-forward, so
``attention_norm`` is Hugging Face's ``post_attention_layernorm``; its q/k norms span all
heads (``nh*d`` and ``nkv*d``), not one head.
"""

from streamck.plan.contract import Row

LAYER = (
    Row("model.layers.{i}.self_attn.q_proj.weight", "blocks.{i}.attention.w_q.weight", ("nh*d", "H")),
    Row("model.layers.{i}.self_attn.k_proj.weight", "blocks.{i}.attention.w_k.weight", ("nkv*d", "H")),
    Row("model.layers.{i}.self_attn.v_proj.weight", "blocks.{i}.attention.w_v.weight", ("nkv*d", "H")),
    Row("model.layers.{i}.self_attn.o_proj.weight", "blocks.{i}.attention.w_out.weight", ("H", "nh*d")),
    Row("model.layers.{i}.self_attn.q_norm.weight", "blocks.{i}.attention.q_norm.weight", ("nh*d",)),
    Row("model.layers.{i}.self_attn.k_norm.weight", "blocks.{i}.attention.k_norm.weight", ("nkv*d",)),
    Row("model.layers.{i}.mlp.gate_proj.weight", "blocks.{i}.feed_forward.w1.weight", ("I", "H")),
    Row("model.layers.{i}.mlp.down_proj.weight", "blocks.{i}.feed_forward.w2.weight", ("H", "I")),
    Row("model.layers.{i}.mlp.up_proj.weight", "blocks.{i}.feed_forward.w3.weight", ("I", "H")),
    Row("model.layers.{i}.post_attention_layernorm.weight", "blocks.{i}.attention_norm.weight", ("H",)),
    Row("model.layers.{i}.post_feedforward_layernorm.weight", "blocks.{i}.feed_forward_norm.weight", ("H",)),
)
TOP = (
    Row("model.embed_tokens.weight", "embeddings.weight", ("V", "H")),
    Row("model.norm.weight", "lm_head.norm.weight", ("H",)),
)
HEAD = Row("lm_head.weight", "lm_head.w_out.weight", ("V", "H"))
# What the output config.json is: save_hf_model builds an Olmo2Config (transformers fills
# every other key with its defaults on load).
ARCHITECTURE = {"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2"}
# The Olmo2Config keys OLMo-core's get_hf_config sets from its model config, besides the sizes:
# fixed values it writes for every OLMo 2.
FIXED = {"hidden_act": "silu", "max_position_embeddings": -1, "pad_token_id": None, "bos_token_id": None,
         "eos_token_id": None}  # fmt: skip
# Where an OLMo-core model config (``TransformerConfig.as_config_dict``, the ``model`` of the
# experiment config its ConfigSaverCallback writes) keeps each value: key path, default.
MODEL_CONFIG = {
    "hidden_size": (("d_model",), None),
    "num_hidden_layers": (("n_layers",), None),
    "vocab_size": (("vocab_size",), None),
    "num_attention_heads": (("block", "sequence_mixer", "n_heads"), None),
    "num_key_value_heads": (("block", "sequence_mixer", "n_kv_heads"), None),
    "attention_bias": (("block", "sequence_mixer", "bias"), False),
    "rope_theta": (("block", "sequence_mixer", "rope", "theta"), None),
    "intermediate_size": (("block", "feed_forward", "hidden_size"), None),
    "rms_norm_eps": (("block", "layer_norm", "eps"), None),
    "tie_word_embeddings": (("tie_word_embeddings",), False),
}
# OLMo-core model config values this plan converts; anything else is another family.
REQUIRED_MODEL = {
    ("block", "name"): "reordered_norm",
    ("block", "sequence_mixer", "qk_norm", "name"): "rms",
    ("block", "sequence_mixer", "use_head_qk_norm"): False,
    ("block", "layer_norm", "name"): "rms",
    ("block", "feed_forward", "activation"): "silu",
    ("block", "feed_forward", "bias"): False,
    ("lm_head", "bias"): False,
}
