"""megatron-core GPTModel (``torch_dist``) keys against Hugging Face's, as data.

GPTModel saves each decoder tensor stacked over its layers under one key with no layer
index (``decoder.layers.…``, leading axis L), norms under Transformer Engine's names.
Each row: Hugging Face name (``{i}``: layer), Megatron key, which rows of it (see
streamck.plan.megatron.plan ROWS; None: all), its Megatron shape in the symbols of
streamck.plan.megatron.sizes (QKV = (heads + 2 * groups) * head_dim; Vp the padded vocab).
Sources: megatron-core 0.19.2 ``gpt_layer_specs.py`` (sharded_state_dict_keys_map),
``attention.py`` (``get_query_key_value_tensors``: per query group, its query heads, then
one key and one value head), ``mlp.py`` (``linear_fc1`` is [gate; up] under swiglu).
"""

LAYER = (
    (
        "model.layers.{i}.input_layernorm.weight",
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
        None,
        ("L", "H"),
    ),
    (
        "model.layers.{i}.self_attn.q_proj.weight",
        "decoder.layers.self_attention.linear_qkv.weight",
        "q",
        ("L", "QKV", "H"),
    ),
    (
        "model.layers.{i}.self_attn.k_proj.weight",
        "decoder.layers.self_attention.linear_qkv.weight",
        "k",
        ("L", "QKV", "H"),
    ),
    (
        "model.layers.{i}.self_attn.v_proj.weight",
        "decoder.layers.self_attention.linear_qkv.weight",
        "v",
        ("L", "QKV", "H"),
    ),
    (
        "model.layers.{i}.self_attn.o_proj.weight",
        "decoder.layers.self_attention.linear_proj.weight",
        None,
        ("L", "H", "nh*d"),
    ),
    (
        "model.layers.{i}.post_attention_layernorm.weight",
        "decoder.layers.mlp.linear_fc1.layer_norm_weight",
        None,
        ("L", "H"),
    ),
    ("model.layers.{i}.mlp.gate_proj.weight", "decoder.layers.mlp.linear_fc1.weight", "gate", ("L", "2*I", "H")),
    ("model.layers.{i}.mlp.up_proj.weight", "decoder.layers.mlp.linear_fc1.weight", "up", ("L", "2*I", "H")),
    ("model.layers.{i}.mlp.down_proj.weight", "decoder.layers.mlp.linear_fc2.weight", None, ("L", "H", "I")),
)
# Transformer Engine's MoE layer spec keeps the norm before the experts a module of its own
# (gpt_layer_specs.py: pre_mlp_layernorm=TENorm when num_experts, no key map for it), so a GPU
# run's MoE checkpoint names it so; the local spec saves it under the dense fused name above.
POST_ATTN_NORM = "decoder.layers.mlp.linear_fc1.layer_norm_weight"
MOE_PRE_MLP_NORM = "decoder.layers.pre_mlp_layernorm.weight"
# --add-qkv-bias (Qwen2's attention_bias): the same query-group split of the bias.
QKV_BIAS = (
    ("model.layers.{i}.self_attn.q_proj.bias", "decoder.layers.self_attention.linear_qkv.bias", "q", ("L", "QKV")),
    ("model.layers.{i}.self_attn.k_proj.bias", "decoder.layers.self_attention.linear_qkv.bias", "k", ("L", "QKV")),
    ("model.layers.{i}.self_attn.v_proj.bias", "decoder.layers.self_attention.linear_qkv.bias", "v", ("L", "QKV")),
)
# --qk-layernorm (Qwen3's q_norm / k_norm).
QK_NORM = (
    (
        "model.layers.{i}.self_attn.q_norm.weight",
        "decoder.layers.self_attention.q_layernorm.weight",
        "norm",
        ("L", "d"),
    ),
    (
        "model.layers.{i}.self_attn.k_norm.weight",
        "decoder.layers.self_attention.k_layernorm.weight",
        "norm",
        ("L", "d"),
    ),
)
TOP = (
    ("model.embed_tokens.weight", "embedding.word_embeddings.weight", "vocab", ("Vp", "H")),
    ("model.norm.weight", "decoder.final_layernorm.weight", None, ("H",)),
)
HEAD = ("lm_head.weight", "output_layer.weight", "vocab", ("Vp", "H"))
# Checkpoint entries that are not model weights.
TRAINING_STATE = ("optimizer.", "rng_state", "common_state")
# Megatron's args that change the layout and are refused (streamck writes no HF model for them).
REFUSED_ARGS = {
    "attention_output_gate": "a gated attention output (its gate rows inside linear_qkv)",
    "add_bias_linear": "biases on every linear layer",
    "layernorm_zero_centered_gamma": "zero-centred norm weights (applied as 1 + w)",
    "apply_residual_connection_post_layernorm": "the residual taken after the norm",
    "qk_l2_norm": "L2-normalised queries and keys",
    "use_rope_scaling": "Llama 3.1 RoPE scaling",
}
# Megatron's args whose values Hugging Face's GPT families hold only at these (arg: the value needed).
FIXED_ARGS = {"rotary_percent": 1.0, "rotary_seq_len_interpolation_factor": None}
# Where Megatron-LM saves the norm epsilon: 0.19 parses --norm-epsilon into ``layernorm_epsilon``.
NORM_EPSILON = ("norm_epsilon", "layernorm_epsilon")
# The Hugging Face model for a GPTModel of these features (architecture, model_type).
HF_MODELS = {"qk_layernorm": ("Qwen3ForCausalLM", "qwen3"), "add_qkv_bias": ("Qwen2ForCausalLM", "qwen2")}
HF_DEFAULT = ("LlamaForCausalLM", "llama")
TRACKER = "latest_checkpointed_iteration.txt"
# MoE layers (megatron-core 0.19.2 ``moe/experts.py`` SequentialMLP / TEGroupedMLP ``sharded_state_dict``:
# the experts stacked over layers and experts, one key each, whatever the expert parallelism; the
# grouped-GEMM layout writes the same keys). Shapes: E experts, Im their hidden size.
MOE_ROUTER = ("decoder.layers.mlp.router.weight", ("L", "E", "H"))
MOE_FC1 = ("decoder.layers.mlp.experts.experts.linear_fc1.weight", ("L", "E", "2*Im", "H"))  # [gate; up]
MOE_FC2 = ("decoder.layers.mlp.experts.experts.linear_fc2.weight", ("L", "E", "H", "Im"))
# The dense MLP rows an MoE layer has not (its pre-MLP norm keeps the dense key).
DENSE_MLP = ("decoder.layers.mlp.linear_fc1.weight", "decoder.layers.mlp.linear_fc2.weight")
# A shared expert (Qwen2-MoE's ``shared_expert``, gated by ``shared_expert_gate``): HF name, key,
# which rows (gate / up of ``linear_fc1``), shape.
MOE_SHARED = (
    ("model.layers.{i}.mlp.shared_expert.gate_proj.weight", "decoder.layers.mlp.shared_experts.linear_fc1.weight",
     "gate", ("L", "2*S", "H")),
    ("model.layers.{i}.mlp.shared_expert.up_proj.weight", "decoder.layers.mlp.shared_experts.linear_fc1.weight",
     "up", ("L", "2*S", "H")),
    ("model.layers.{i}.mlp.shared_expert.down_proj.weight", "decoder.layers.mlp.shared_experts.linear_fc2.weight",
     None, ("L", "H", "S")),
    ("model.layers.{i}.mlp.shared_expert_gate.weight", "decoder.layers.mlp.shared_experts.gate_weight", None,
     ("L", "1", "H")),
)  # fmt: skip
# The MoE families a GPTModel converts to, by model_type: its features (each must match the
# checkpoint's), the config keys of the experts' and the shared expert's hidden sizes, and
# whether it renormalises the top-k routing weights (a bool, or the config key that says), and its
# transformers class (the config written from the args alone names it).
MOE_FAMILIES = {
    "qwen3_moe": {"q/k norms": True, "a qkv bias": False, "a shared expert": False, "a shared expert gate": False,
                  "expert_size": "moe_intermediate_size", "shared_size": None, "renormalise": "norm_topk_prob",
                  "architecture": "Qwen3MoeForCausalLM"},
    "qwen2_moe": {"q/k norms": False, "a qkv bias": True, "a shared expert": True, "a shared expert gate": True,
                  "expert_size": "moe_intermediate_size", "shared_size": "shared_expert_intermediate_size",
                  "renormalise": "norm_topk_prob", "architecture": "Qwen2MoeForCausalLM"},
    "mixtral": {"q/k norms": False, "a qkv bias": False, "a shared expert": False, "a shared expert gate": False,
                "expert_size": "intermediate_size", "shared_size": None, "renormalise": True,
                "architecture": "MixtralForCausalLM"},
}  # fmt: skip
