"""torchtitan 0.3.0's DeepSeek-V3 parameter names against Hugging Face's DeepseekV3, as data.

Source: torchtitan 0.3.0 ``models/deepseek_v3/state_dict_adapter.py`` (``from_hf_map``, whose
``to_hf`` renames only: no row is reordered; torchtitan's RoPE pairs are interleaved and
transformers' DeepseekV3 reads them so with ``rope_interleave: true``). Each row
(streamck.plan.contract.Row): the Hugging Face suffix under ``model.layers.N.`` (``out``),
torchtitan's under ``layers.N.`` or ``mtp_layers.K.`` (``src``), and the shape in the symbols
below. The routed experts are layout.MOE_EXPERTS's rows (same names as Qwen3-MoE's).
"""

from streamck.plan.contract import Row

# Shape symbols -> the Hugging Face config key (or sum) behind each, in shape errors.
SYMBOLS = {
    "H": "hidden_size",
    "nh": "num_attention_heads",
    "I": "intermediate_size",
    "V": "vocab_size",
    "qa": "q_lora_rank",
    "kv": "kv_lora_rank",
    "dv": "v_head_dim",
    "E": "n_routed_experts",
    "Im": "moe_intermediate_size",
    "dq": "qk_nope_head_dim + qk_rope_head_dim",
    "kvr": "kv_lora_rank + qk_rope_head_dim",
    "dkv": "qk_nope_head_dim + v_head_dim",
    "Is": "moe_intermediate_size * n_shared_experts",
}
# Multi-head latent attention, every layer.
ATTENTION = (
    Row("self_attn.kv_a_proj_with_mqa.weight", "attention.wkv_a.weight", ("kvr", "H")),
    Row("self_attn.kv_a_layernorm.weight", "attention.kv_norm.weight", ("kv",)),
    Row("self_attn.kv_b_proj.weight", "attention.wkv_b.weight", ("nh*dkv", "kv")),
    Row("self_attn.o_proj.weight", "attention.wo.weight", ("H", "nh*dv")),
    Row("input_layernorm.weight", "attention_norm.weight", ("H",)),
    Row("post_attention_layernorm.weight", "ffn_norm.weight", ("H",)),
)
# The query: one projection (``q_lora_rank`` null or 0) or a low-rank pair with a norm between.
QUERY_FULL = (Row("self_attn.q_proj.weight", "attention.wq.weight", ("nh*dq", "H")),)
QUERY_LORA = (
    Row("self_attn.q_a_proj.weight", "attention.wq_a.weight", ("qa", "H")),
    Row("self_attn.q_a_layernorm.weight", "attention.q_norm.weight", ("qa",)),
    Row("self_attn.q_b_proj.weight", "attention.wq_b.weight", ("nh*dq", "qa")),
)
# The first ``first_k_dense_replace`` layers (torchtitan's ``n_dense_layers``).
DENSE = (
    Row("mlp.gate_proj.weight", "feed_forward.w1.weight", ("I", "H")),
    Row("mlp.up_proj.weight", "feed_forward.w3.weight", ("I", "H")),
    Row("mlp.down_proj.weight", "feed_forward.w2.weight", ("H", "I")),
)
# The other layers: router, shared experts (routed experts: layout.MOE_EXPERTS).
MOE = (
    Row("mlp.gate.weight", "moe.router.gate.weight", ("E", "H")),
    Row("mlp.shared_experts.gate_proj.weight", "moe.shared_experts.w1.weight", ("Is", "H")),
    Row("mlp.shared_experts.up_proj.weight", "moe.shared_experts.w3.weight", ("Is", "H")),
    Row("mlp.shared_experts.down_proj.weight", "moe.shared_experts.w2.weight", ("H", "Is")),
)
# The load-balancing bias: a buffer only when torchtitan's load_balance_coeff is set.
BIAS = Row("mlp.gate.e_score_correction_bias", "moe.expert_bias_E", ("E",))
# A multi-token-prediction layer's own tensors, beside a full decoder layer; Hugging Face numbers
# MTP layer K as decoder layer num_hidden_layers + K (DeepSeek-V3's layer 61).
MTP = (
    Row("enorm.weight", "enorm.weight", ("H",)),
    Row("hnorm.weight", "hnorm.weight", ("H",)),
    Row("eh_proj.weight", "eh_proj.weight", ("H", "2*H")),
    Row("shared_head.norm.weight", "mtp_norm.weight", ("H",)),
)
TOP = (
    Row("model.embed_tokens.weight", "tok_embeddings.weight", ("V", "H")),
    Row("model.norm.weight", "norm.weight", ("H",)),
)
HEAD = Row("lm_head.weight", "lm_head.weight", ("V", "H"))
# The config keys that state the MTP layer count (transformers 5 maps one onto the other).
MTP_KEYS = ("num_nextn_predict_layers", "num_mtp_layers")
