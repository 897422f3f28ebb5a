"""The EAGLE-4 contract (``docs/eagle4.md``) as data: the config key lists, the
shape symbols, and the training → serving tensor table. ``eagle4.py`` holds the checks."""

from streamck.plan.contract import Row

ARCHITECTURE = "LlamaForCausalLMEagle4"

# Serving config: these keys are set, these are copied when present, nothing else survives.
SET_CONFIG = {"architectures": [ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1}
COPIED_CONFIG = (
    "attention_bias",
    "attention_dropout",
    "bos_token_id",
    "eagle_config",
    "efficient_lm_head_candidates",
    "efficient_lm_head_rank",
    "eos_token_id",
    "head_dim",
    "hidden_act",
    "hidden_size",
    "intermediate_size",
    "max_position_embeddings",
    "mlp_bias",
    "num_attention_heads",
    "num_key_value_heads",
    "pad_token_id",
    "rms_norm_eps",
    "rope_scaling",
    "rope_theta",
    "sliding_window",
    "target_hidden_size",
    "tie_word_embeddings",
    "torch_dtype",
    "vocab_size",
)
REQUIRED_SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "efficient_lm_head_rank",
)
OPTIONAL_SIZES = ("head_dim", "target_hidden_size")
AUX_LAYERS = ("eagle_config", "eagle_aux_hidden_state_layer_ids")
REFUSED_FLAGS = ("parallel_drafting", "fc_norm")  # true at top level or in eagle_config: not built by EAGLE-4

# Shape symbols and the config keys behind each, for error messages.
SYMBOLS = {
    "H": "hidden_size",
    "T": "target_hidden_size (default hidden_size)",
    "A": "len(eagle_config.eagle_aux_hidden_state_layer_ids)",
    "nh": "num_attention_heads",
    "nkv": "num_key_value_heads",
    "d": "head_dim (default hidden_size / num_attention_heads)",
    "I": "intermediate_size",
    "V": "vocab_size",
    "R": "efficient_lm_head_rank",
}

STRUCTURE_LABELS = {
    "H": "H",
    "T": "T",
    "A": "A",
    "nh": "heads",
    "nkv": "kv_heads",
    "d": "head_dim",
    "I": "I",
    "V": "V",
    "R": "R",
}

# streamck.plan.contract.Row: serving key (out), training key (src), shape as products of symbols
TENSORS = (
    Row("fc.weight", "model.fc.weight", ("H", "A*T")),
    Row("layers.0.hidden_norm.weight", "model.layers.0.hidden_norm.weight", ("H",)),
    Row("layers.0.input_layernorm.weight", "model.layers.0.input_layernorm.weight", ("H",)),
    Row("layers.0.post_attention_layernorm.weight", "model.layers.0.post_attention_layernorm.weight", ("H",)),
    Row("layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight", ("nh*d", "2*H")),
    Row("layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.k_proj.weight", ("nkv*d", "2*H")),
    Row("layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.v_proj.weight", ("nkv*d", "2*H")),
    Row("layers.0.self_attn.o_proj.weight", "model.layers.0.self_attn.o_proj.weight", ("H", "nh*d")),
    Row("layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.gate_proj.weight", ("I", "H")),
    Row("layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight", ("I", "H")),
    Row("layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight", ("H", "I")),
    Row("norm.weight", "model.norm.weight", ("H",)),
    Row("embed_tokens.weight", "model.embed_tokens.weight", ("V", "H")),
    Row("lm_head.weight", "lm_head.weight", ("V", "H")),
    Row("efficient_lm_head_down_proj.weight", "efficient_lm_head_down_proj.weight", ("R", "H")),
    Row("efficient_lm_head.weight", "efficient_lm_head.weight", ("V", "R")),
)
# Present exactly when their config flag is true.
BIASES = {
    "attention_bias": (
        Row("layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.q_proj.bias", ("nh*d",)),
        Row("layers.0.self_attn.k_proj.bias", "model.layers.0.self_attn.k_proj.bias", ("nkv*d",)),
        Row("layers.0.self_attn.v_proj.bias", "model.layers.0.self_attn.v_proj.bias", ("nkv*d",)),
        Row("layers.0.self_attn.o_proj.bias", "model.layers.0.self_attn.o_proj.bias", ("H",)),
    ),
    "mlp_bias": (
        Row("layers.0.mlp.gate_proj.bias", "model.layers.0.mlp.gate_proj.bias", ("I",)),
        Row("layers.0.mlp.up_proj.bias", "model.layers.0.mlp.up_proj.bias", ("I",)),
        Row("layers.0.mlp.down_proj.bias", "model.layers.0.mlp.down_proj.bias", ("H",)),
    ),
}
SECOND_LAYER_PREFIX = "model.layers."
FLOAT_DTYPES = ("F32", "BF16", "F16")
