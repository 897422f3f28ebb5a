"""The EAGLE-3 export tables as data: what a NeMo Automodel draft holds, the one serving
layout vLLM and SGLang both load, and the speculators config. ``eagle3.py`` holds the checks.

Read from (the versions each table follows):
- source: nemo_automodel 0.7.0, components/speculative/eagle/draft_llama.py
  (LlamaEagle3DraftModel) and recipes/llm/train_eagle3.py (the draft config it writes);
- native layout: vLLM 0.33 model_executor/models/llama_eagle3.py (Eagle3LlamaForCausalLM,
  its EAGLEConfig) and SGLang 0.5.23 srt/models/llama_eagle3.py (LlamaForCausalLMEagle3);
- speculators layout: speculators 0.9.0 models/eagle3/config.py (Eagle3SpeculatorConfig),
  models/eagle3/core.py (Eagle3DraftModel) and config.py (SpeculatorsConfig).
"""

SOURCE_VERSION = "nemo_automodel 0.7.0"
ENGINE_VERSIONS = "vLLM 0.33 (llama_eagle3.py), SGLang 0.5.23 (llama_eagle3.py)"
SPECULATORS_VERSION = "0.9.0"

ARCHITECTURE = "LlamaForCausalLMEagle3"  # SGLang's class name; vLLM registers it for Eagle3LlamaForCausalLM

# Both engines build the fc for this many aux hidden states (vLLM: target_hidden_size * 3).
AUX_STATES = 3
# Where a training config may hold the aux layer ids (first found wins).
AUX_LAYER_KEYS = (("eagle_config", "eagle_aux_hidden_state_layer_ids"), ("eagle_aux_hidden_state_layer_ids",))

REQUIRED_SIZES = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size")
OPTIONAL_SIZES = ("head_dim", "target_hidden_size", "draft_vocab_size")
# EAGLE-3.1 toggles: read from the training config (absent = false) and always written out.
EXPLICIT_FLAGS = ("fc_norm", "norm_output")

# Refused, with the reason. Flags refused when true, at top level or in eagle_config:
REFUSED_FLAGS = {
    "parallel_drafting": "P-EAGLE (parallel drafting) is served by vLLM only, not by this plan",
    "attention_bias": "SGLang builds the EAGLE-3 attention without biases and ignores them silently",
    "mlp_bias": "SGLang builds the EAGLE-3 MLP without biases and ignores them silently",
    "norm_before_fc": "a single pre-fc RMSNorm (input_norm) is a structure these loaders do not build",
}
# Config keys that mark a P-EAGLE draft whatever their value.
PEAGLE_CONFIG_KEYS = ("pard_token",)
# Training tensors that mark a P-EAGLE draft.
PEAGLE_TENSORS = ("mask_hidden",)
LAYER_PREFIX = "model.layers."  # the draft has exactly layers.0

# Serving config.json (--plan eagle3): set, computed from the symbols, copied when present.
SET_CONFIG = {
    "architectures": [ARCHITECTURE],
    "model_type": "llama",
    "num_hidden_layers": 1,
    "tie_word_embeddings": False,
    # Automodel's layer keeps the raw hidden state as the residual (norm after residual).
    "norm_before_residual": False,
}
LLAMA_CONFIG = (
    "attention_dropout",
    "bos_token_id",
    "eos_token_id",
    "hidden_act",
    "hidden_size",
    "intermediate_size",
    "max_position_embeddings",
    "num_attention_heads",
    "num_key_value_heads",
    "pad_token_id",
    "rms_norm_eps",
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "vocab_size",
)
DTYPE_KEYS = ("torch_dtype", "dtype")  # copied, and following a --dtype cast

# speculators 0.9 config.json (--plan eagle3-speculators).
SPECULATORS_SET = {
    "architectures": ["Eagle3Speculator"],
    "speculators_model_type": "eagle3",
    "speculators_version": SPECULATORS_VERSION,
    # vLLM's speculators adapter defaults norm_before_residual to true when it is absent.
    "norm_before_residual": False,
    "norm_before_fc": False,
}
PROPOSAL = {"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1, "accept_tolerance": 0.0}
LAYER_CONFIG_SET = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_hidden_layers": 1,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
}

# Shape symbols and the config keys behind each, for error messages.
SYMBOLS = {
    "H": "hidden_size",
    "T": "target_hidden_size (default hidden_size)",
    "A": "aux hidden states (3)",
    "nh": "num_attention_heads",
    "nkv": "num_key_value_heads",
    "d": "head_dim (default hidden_size / num_attention_heads)",
    "I": "intermediate_size",
    "V": "vocab_size",
    "Vd": "draft_vocab_size (default vocab_size)",
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
    "Vd": "draft_V",
}

FLOAT = ("F32", "BF16", "F16")
# (serving key, training key, shape as products of symbols, allowed dtypes)
TENSORS = (
    ("embed_tokens.weight", "model.embed_tokens.weight", ("V", "H"), FLOAT),
    ("fc.weight", "model.fc.weight", ("H", "A*T"), FLOAT),
    ("layers.0.hidden_norm.weight", "model.layers.0.hidden_norm.weight", ("H",), FLOAT),
    ("layers.0.input_layernorm.weight", "model.layers.0.input_layernorm.weight", ("H",), FLOAT),
    ("layers.0.post_attention_layernorm.weight", "model.layers.0.post_attention_layernorm.weight", ("H",), FLOAT),
    ("layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight", ("nh*d", "2*H"), FLOAT),
    ("layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.k_proj.weight", ("nkv*d", "2*H"), FLOAT),
    ("layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.v_proj.weight", ("nkv*d", "2*H"), FLOAT),
    ("layers.0.self_attn.o_proj.weight", "model.layers.0.self_attn.o_proj.weight", ("H", "nh*d"), FLOAT),
    ("layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.gate_proj.weight", ("I", "H"), FLOAT),
    ("layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight", ("I", "H"), FLOAT),
    ("layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight", ("H", "I"), FLOAT),
    ("norm.weight", "model.norm.weight", ("H",), FLOAT),
    ("lm_head.weight", "lm_head.weight", ("Vd", "H"), FLOAT),
)
# One per aux hidden state ({i} = 0 .. A-1), exactly when fc_norm is true (EAGLE-3.1).
FC_NORM = ("fc_norm.{i}.weight", "model.fc_norm.{i}.weight", ("T",), FLOAT)
# Exactly when draft_vocab_size < vocab_size: d2t[i] = target id - i (vLLM), t2d a target mask (SGLang skips it).
VOCAB_MAP = (
    ("d2t", "d2t", ("Vd",), ("I64",)),
    ("t2d", "t2d", ("V",), ("BOOL",)),
)
