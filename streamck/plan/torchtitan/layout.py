"""torchtitan's Llama 3 / Qwen3 (dense) parameter names against Hugging Face's, as data.

Each row (streamck.plan.contract.Row): Hugging Face name (``out``), torchtitan 0.3 name
(``src``), its shape in the config's symbols (streamck.plan.hf_export.SYMBOLS), the row
permutation it needs (``permute``: ``q``/``k``, RoPE pairs to halves over the query or
key/value heads; None: rows as stored) and torchtitan 0.2's name where it differs (``legacy``). ``{i}`` is the
layer index.
Sources: torchtitan 0.3.0 ``models/llama3/state_dict_adapter.py`` and
``models/qwen3/state_dict_adapter.py`` (``from_hf_map``); 0.2 kept q/k/v directly under
``attention`` (``layers.{i}.attention.wq.weight``).
"""

from streamck.plan.contract import Row

LAYER = (
    Row(
        "model.layers.{i}.self_attn.q_proj.weight",
        "layers.{i}.attention.qkv_linear.wq.weight",
        ("nh*d", "H"),
        permute="q",
        legacy="layers.{i}.attention.wq.weight",
    ),
    Row(
        "model.layers.{i}.self_attn.k_proj.weight",
        "layers.{i}.attention.qkv_linear.wk.weight",
        ("nkv*d", "H"),
        permute="k",
        legacy="layers.{i}.attention.wk.weight",
    ),
    Row(
        "model.layers.{i}.self_attn.v_proj.weight",
        "layers.{i}.attention.qkv_linear.wv.weight",
        ("nkv*d", "H"),
        legacy="layers.{i}.attention.wv.weight",
    ),
    Row("model.layers.{i}.self_attn.o_proj.weight", "layers.{i}.attention.wo.weight", ("H", "nh*d")),
    Row("model.layers.{i}.mlp.gate_proj.weight", "layers.{i}.feed_forward.w1.weight", ("I", "H")),
    Row("model.layers.{i}.mlp.up_proj.weight", "layers.{i}.feed_forward.w3.weight", ("I", "H")),
    Row("model.layers.{i}.mlp.down_proj.weight", "layers.{i}.feed_forward.w2.weight", ("H", "I")),
    Row("model.layers.{i}.input_layernorm.weight", "layers.{i}.attention_norm.weight", ("H",)),
    Row("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.ffn_norm.weight", ("H",)),
)
# Qwen3's per-head norms of q and k (its RoPE is rotate-half already: no permutation).
QK_NORM = (
    Row("model.layers.{i}.self_attn.q_norm.weight", "layers.{i}.attention.q_norm.weight", ("d",)),
    Row("model.layers.{i}.self_attn.k_norm.weight", "layers.{i}.attention.k_norm.weight", ("d",)),
)
TOP = (
    Row("model.embed_tokens.weight", "tok_embeddings.weight", ("V", "H")),
    Row("model.norm.weight", "norm.weight", ("H",)),
)
HEAD = Row("lm_head.weight", "lm_head.weight", ("V", "H"), legacy="output.weight")
# Which key names which version: the first layer's query weight.
VERSIONS = {"0.3": LAYER[0].at(i=0).src, "0.2": LAYER[0].at(i=0).legacy}
# The families, by the Hugging Face config's model_type: (permute q/k, has q/k norms).
FAMILIES = {"llama": (True, False), "qwen3": (False, True), "qwen3_moe": (False, True)}
# Top-level checkpoint entries that are training state, never model weights.
TRAINING_STATE = ("optimizer.", "lr_scheduler.", "dataloader.", "train_state.")

# MoE layers (torchtitan 0.3.0 ``models/common/moe.py``; names as ``models/qwen3/state_dict_adapter.py``
# maps them): the router, and per HF projection the grouped weight whose index e is expert e's.
# Shapes in symbols: E experts, Im the experts' hidden size (``moe_intermediate_size``).
MOE_ROUTER = Row("model.layers.{i}.mlp.gate.weight", "layers.{i}.moe.router.gate.weight", ("E", "H"))
MOE_EXPERTS = (
    Row(
        "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
        "layers.{i}.moe.routed_experts.inner_experts.w1_EFD",
        ("E", "Im", "H"),
    ),
    Row(
        "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
        "layers.{i}.moe.routed_experts.inner_experts.w3_EFD",
        ("E", "Im", "H"),
    ),
    Row(
        "model.layers.{i}.mlp.experts.{e}.down_proj.weight",
        "layers.{i}.moe.routed_experts.inner_experts.w2_EDF",
        ("E", "H", "Im"),
    ),
)
# The auxiliary-loss-free load-balancing bias (a buffer saved with the model when load balancing is on).
MOE_BIAS = "layers.{i}.moe.expert_bias_E"
MOE_SHARED = "layers.{i}.moe.shared_experts."
# MoE families by model_type: the config key of the experts' hidden size.
MOE_FAMILIES = {"qwen3_moe": "moe_intermediate_size"}
