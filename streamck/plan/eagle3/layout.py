"""The EAGLE-3 export tables as data: what a NeMo Automodel draft holds, the one serving
layout vLLM and SGLang both load, and the speculators config. ``eagle3.py`` holds the checks.

Read from (the versions each table follows):
- source: nemo_automodel 0.7.0, components/speculative/eagle/draft_llama.py
  (LlamaEagle3DraftModel), recipes/llm/train_eagle3.py (the draft config it writes, lines
  610-658: the target's transformers-5 ``to_dict()`` plus the recipe's keys, no aux ids) and
  the recipe snapshot ``save_config`` writes beside it (``config.yaml``);
- native layout: vLLM 0.33 model_executor/models/llama_eagle3.py (Eagle3LlamaForCausalLM)
  and SGLang 0.5.23 srt/models/llama_eagle3.py (LlamaForCausalLMEagle3), both reading the
  config through transformers 5's LlamaConfig;
- speculators layout: speculators 0.9.0 models/eagle3/config.py (Eagle3SpeculatorConfig),
  models/eagle3/core.py (Eagle3DraftModel) and config.py (SpeculatorsConfig).
"""

from streamck.plan.contract import Row

SOURCE_VERSION = "nemo_automodel 0.7.0"
ENGINE_VERSIONS = "vLLM 0.33 (llama_eagle3.py), SGLang 0.5.23 (llama_eagle3.py)"
SPECULATORS_VERSION = "0.9.0"

ARCHITECTURE = "LlamaForCausalLMEagle3"  # SGLang's class name; vLLM registers it for Eagle3LlamaForCausalLM

# Aux layer ids. Automodel's id k is the output of target layer k (eagle/target.py hooks it;
# eagle/vllm_runner.py adds 1 for vLLM). Each serving key, what it adds to k, and who reads it:
AUX_ID_KEYS = (
    # vLLM 0.33 reads this one first (v1/worker/gpu_model_runner.py
    # _get_eagle3_aux_layers_from_config), its V2 runner only this one (v1/worker/gpu/
    # spec_decode/eagle/eagle3_utils.py); its id j is the input of layer j (models/llama.py
    # records the output of layer idx under idx + 1).
    (("eagle_aux_hidden_state_layer_ids",), 1, "vLLM"),
    # SGLang 0.5.23 reads only this one (model_runner_components/spec_aux_hidden_state.py) and
    # adds 1 itself (models/llama.py set_eagle3_layers_to_capture); vLLM's fallback.
    (("eagle_config", "eagle_aux_hidden_state_layer_ids"), 0, "SGLang"),
)
# speculators 0.9 keeps vLLM's convention (models/utils.py resolve_target_layer_ids: default
# [2, n//2, n-3], up to n) and vLLM's adapter passes the top-level ids on as they are
# (transformers_utils/configs/speculators/algos.py update_eagle3).
SPECULATORS_AUX_KEYS = ((("eagle_aux_hidden_state_layer_ids",), 1, "vLLM and speculators"),)
# The highest Automodel id each plan can serve, below the target's n layers: SGLang captures
# layer k's output at the input of layer k + 1, which the last layer does not have; vLLM
# records the last layer's output too (under id n).
AUX_TOP = {
    "eagle3": (2, ": SGLang 0.5.23 captures layer k's output at the input of layer k + 1, which the last has not"),
    "eagle3-speculators": (1, ""),
}
# Where a training config may hold ids (Automodel writes none), with the shift to take off.
CONFIG_AUX_KEYS = tuple((path, shift) for path, shift, _ in reversed(AUX_ID_KEYS))
# The recipe snapshot train_eagle3.py writes into each step (save_config), and the key under
# which it holds the ids the user chose (absent: the default, eagle/target.py
# default_eagle3_aux_layer_ids).
RECIPE_SNAPSHOT = "config.yaml"
RECIPE_AUX_KEY = ("recipe_args", "aux_layer_ids")
DEFAULT_AUX = "[1, n//2 - 1, n - 4]"

REQUIRED_SIZES = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size")
OPTIONAL_SIZES = ("head_dim", "target_hidden_size", "draft_vocab_size", "num_aux_hidden_states")
# Norm toggles: read from the training config (absent = false) and always written out.
# Automodel writes fc_norm and norm_output (EAGLE-3.1); norm_before_fc (one RMSNorm over the
# concatenated aux states, ``input_norm``) it never builds, but both engines and speculators do.
EXPLICIT_FLAGS = ("fc_norm", "norm_output", "norm_before_fc")

# Refused, with the reason. Flags refused when true, at top level or in eagle_config:
REFUSED_FLAGS = {
    "parallel_drafting": "P-EAGLE (parallel drafting) is served by vLLM only, not by this plan",
    "attention_bias": "SGLang builds the EAGLE-3 attention without biases and ignores them silently",
    "mlp_bias": "SGLang builds the EAGLE-3 MLP without biases and ignores them silently",
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
    "vocab_size",
)
# transformers 5 writes dtype (4: torch_dtype) and rope_parameters holding rope_theta (4:
# rope_theta and rope_scaling). Both engines read the config through transformers 5's
# LlamaConfig, which takes either, so the serving config writes the 5 form: dtype (following
# a --dtype cast) and rope_parameters.
DTYPE_KEYS = ("dtype", "torch_dtype")
# The draft's one layer attends fully (Automodel's Eagle3LlamaAttention has no sliding window);
# a target's layer_types (Qwen3: one per target layer) would fail LlamaConfig's check against
# num_hidden_layers 1, and vLLM indexes it by the draft's layer.
LAYER_TYPES = ["full_attention"]

# speculators 0.9 config.json (--plan eagle3-speculators).
SPECULATORS_SET = {
    "architectures": ["Eagle3Speculator"],
    "speculators_model_type": "eagle3",
    "speculators_version": SPECULATORS_VERSION,
    # vLLM's speculators adapter defaults norm_before_residual to true when it is absent.
    "norm_before_residual": False,
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
    "A": "aux hidden states (num_aux_hidden_states, default 3)",
    "nh": "num_attention_heads",
    "nkv": "num_key_value_heads",
    "d": "head_dim (default hidden_size / num_attention_heads)",
    "I": "intermediate_size",
    "V": "vocab_size",
    "Vd": "draft_vocab_size (default vocab_size)",
}
STRUCTURE_LABELS = {
    "n": "target_layers",
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
# streamck.plan.contract.Row: serving key (out), training key (src), shape as products of symbols, allowed dtypes
TENSORS = (
    Row("embed_tokens.weight", "model.embed_tokens.weight", ("V", "H"), FLOAT),
    Row("fc.weight", "model.fc.weight", ("H", "A*T"), FLOAT),
    Row("layers.0.hidden_norm.weight", "model.layers.0.hidden_norm.weight", ("H",), FLOAT),
    Row("layers.0.input_layernorm.weight", "model.layers.0.input_layernorm.weight", ("H",), FLOAT),
    Row("layers.0.post_attention_layernorm.weight", "model.layers.0.post_attention_layernorm.weight", ("H",), FLOAT),
    Row("layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight", ("nh*d", "2*H"), FLOAT),
    Row("layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.k_proj.weight", ("nkv*d", "2*H"), FLOAT),
    Row("layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.v_proj.weight", ("nkv*d", "2*H"), FLOAT),
    Row("layers.0.self_attn.o_proj.weight", "model.layers.0.self_attn.o_proj.weight", ("H", "nh*d"), FLOAT),
    Row("layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.gate_proj.weight", ("I", "H"), FLOAT),
    Row("layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight", ("I", "H"), FLOAT),
    Row("layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight", ("H", "I"), FLOAT),
    Row("norm.weight", "model.norm.weight", ("H",), FLOAT),
    Row("lm_head.weight", "lm_head.weight", ("Vd", "H"), FLOAT),
)
# One per aux hidden state ({i} = 0 .. A-1), exactly when fc_norm is true (EAGLE-3.1).
FC_NORM = Row("fc_norm.{i}.weight", "model.fc_norm.{i}.weight", ("T",), FLOAT)
# Exactly when norm_before_fc: one RMSNorm over the concatenated aux states (both engines: input_norm).
NORM_BEFORE_FC = Row("input_norm.weight", "model.input_norm.weight", ("A*T",), FLOAT)
# Exactly when draft_vocab_size < vocab_size: d2t[i] = target id - i (vLLM), t2d a target mask (SGLang skips it).
VOCAB_MAP = (
    Row("d2t", "d2t", ("Vd",), ("I64",)),
    Row("t2d", "t2d", ("V",), ("BOOL",)),
)
