"""megatron-core's DeepSeek-V3 GPTModel (multi-latent attention, MoE) against Hugging Face's
DeepseekV3, as data.

Sources: megatron-core 0.19.2 ``transformer/multi_latent_attention.py`` (``MLASelfAttention``:
``linear_q_down_proj`` [qa, H], ``q_layernorm``, ``linear_q_up_proj`` [nh*(nope+rope), qa] whose
rows are per head [nope | rope]; ``linear_kv_down_proj`` [kv + rope, H] (latent, then the shared
rope key); ``kv_layernorm``; ``linear_kv_up_proj`` [nh*(nope+v), kv] per head [k_nope | v]; RoPE
applied with ``mla_rotary_interleaved``: pairs (0,1), (2,3)… as transformers' ``rope_interleave:
true`` reads them), ``models/gpt/gpt_layer_specs.py`` (where the norms sit: the local spec's
``q_layernorm`` / ``kv_layernorm`` / ``pre_mlp_layernorm``, Transformer Engine's fused
``linear_q_up_proj.layer_norm_weight`` / ``linear_kv_up_proj.layer_norm_weight`` and a dense layer's
``mlp.linear_fc1.layer_norm_weight``) and ``moe/router.py`` (``expert_bias``, a float32 buffer).
Each row: Hugging Face suffix under ``model.layers.N.``, Megatron suffixes under
``decoder.layers.`` (alternatives: the local spec's name first, then TE's), which rows (None: all;
``gate`` / ``up``: the halves of a ``linear_fc1``), shape of one layer's tensor in SYMBOLS. Every
matrix is written with its rows as stored.
"""

# Shape symbols -> the Hugging Face config key (or sum) behind each, in shape errors.
SYMBOLS = {
    "H": "hidden_size",
    "nh": "num_attention_heads",
    "I": "intermediate_size",
    "V": "vocab_size",
    "Vp": "the padded vocabulary's rows",
    "L": "num_hidden_layers",
    "qa": "q_lora_rank",
    "kv": "kv_lora_rank",
    "dv": "v_head_dim",
    "E": "n_routed_experts",
    "Im": "moe_intermediate_size",
    "S": "moe_intermediate_size * n_shared_experts",
    "dq": "qk_nope_head_dim + qk_rope_head_dim",
    "kvr": "kv_lora_rank + qk_rope_head_dim",
    "dkv": "qk_nope_head_dim + v_head_dim",
}
ATTENTION = (
    ("input_layernorm.weight", ("input_layernorm.weight",), None, ("H",)),
    ("self_attn.kv_a_proj_with_mqa.weight", ("self_attention.linear_kv_down_proj.weight",), None, ("kvr", "H")),
    ("self_attn.kv_a_layernorm.weight",
     ("self_attention.kv_layernorm.weight", "self_attention.linear_kv_up_proj.layer_norm_weight"), None, ("kv",)),
    ("self_attn.kv_b_proj.weight", ("self_attention.linear_kv_up_proj.weight",), None, ("nh*dkv", "kv")),
    ("self_attn.o_proj.weight", ("self_attention.linear_proj.weight",), None, ("H", "nh*dv")),
)  # fmt: skip
# The query: a low-rank pair with its norm between (``q_lora_rank``), or one projection.
QUERY_LORA = (
    ("self_attn.q_a_proj.weight", ("self_attention.linear_q_down_proj.weight",), None, ("qa", "H")),
    ("self_attn.q_a_layernorm.weight",
     ("self_attention.q_layernorm.weight", "self_attention.linear_q_up_proj.layer_norm_weight"), None, ("qa",)),
    ("self_attn.q_b_proj.weight", ("self_attention.linear_q_up_proj.weight",), None, ("nh*dq", "qa")),
)  # fmt: skip
QUERY_FULL = (("self_attn.q_proj.weight", ("self_attention.linear_q_proj.weight",), None, ("nh*dq", "H")),)
# The first ``first_k_dense_replace`` layers (Megatron's ``moe_layer_freq`` 0s).
DENSE = (
    ("post_attention_layernorm.weight", ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"), None,
     ("H",)),
    ("mlp.gate_proj.weight", ("mlp.linear_fc1.weight",), "gate", ("2*I", "H")),
    ("mlp.up_proj.weight", ("mlp.linear_fc1.weight",), "up", ("2*I", "H")),
    ("mlp.down_proj.weight", ("mlp.linear_fc2.weight",), None, ("H", "I")),
)  # fmt: skip
# The MoE layers: router, its load-balancing bias, the shared expert (routed experts: EXPERTS).
MOE = (
    ("post_attention_layernorm.weight", ("pre_mlp_layernorm.weight",), None, ("H",)),
    ("mlp.gate.weight", ("mlp.router.weight",), None, ("E", "H")),
    ("mlp.gate.e_score_correction_bias", ("mlp.router.expert_bias",), None, ("E",)),
    ("mlp.shared_experts.gate_proj.weight", ("mlp.shared_experts.linear_fc1.weight",), "gate", ("2*S", "H")),
    ("mlp.shared_experts.up_proj.weight", ("mlp.shared_experts.linear_fc1.weight",), "up", ("2*S", "H")),
    ("mlp.shared_experts.down_proj.weight", ("mlp.shared_experts.linear_fc2.weight",), None, ("H", "S")),
)
# Routed experts, [E, …] per layer: expert e's gate rows then up rows, and its down projection.
EXPERTS = (
    ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.experts.linear_fc1.weight", "gate", ("E", "2*Im", "H")),
    ("mlp.experts.{e}.up_proj.weight", "mlp.experts.experts.linear_fc1.weight", "up", ("E", "2*Im", "H")),
    ("mlp.experts.{e}.down_proj.weight", "mlp.experts.experts.linear_fc2.weight", None, ("E", "H", "Im")),
)
# The hidden size behind each linear_fc1's halves, by the row's Megatron key.
HALVES = {"mlp.linear_fc1.weight": "I", "mlp.shared_experts.linear_fc1.weight": "S",
          "mlp.experts.experts.linear_fc1.weight": "Im"}  # fmt: skip
# Megatron tensors that HF DeepseekV3 has no place for (a key ending so, in any layer): refused.
NO_PLACE = {
    "self_attention.linear_q_proj.layer_norm_weight": "a norm before the full-rank query projection "
    "(megatron-core puts one there under --qk-layernorm without --q-lora-rank)",
    "mlp.shared_experts.gate_weight": "a gated shared expert (--moe-shared-expert-gate)",
    "mlp.router.bias": "a router bias",
}
# Megatron's fused forms of tensors HF DeepseekV3 keeps apart: the arg that fuses them, its key, and why
# it is refused (Transformer Engine's spec under --mla-down-proj-fusion: q_a_proj's and kv_a_proj_with_mqa's
# rows in one linear, the input norm fused into it).
FUSED = (
    ("mla_down_proj_fusion", "self_attention.linear_qkv_down_proj.weight",
     "the q and kv down-projections fused into one linear (--mla-down-proj-fusion), which --plan megatron-gpt "
     "does not split into q_a_proj and kv_a_proj_with_mqa: save without --mla-down-proj-fusion"),
)  # fmt: skip
PREFIX = "decoder.layers."
MTP_PREFIX = "mtp."
HF_TYPE = "deepseek_v3"
