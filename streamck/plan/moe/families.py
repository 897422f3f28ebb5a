"""How each Hugging Face MoE family names its experts: at run time (what a trainer saves from
``model.state_dict()``) and on disk (what ``save_pretrained`` writes), as data (the layout's
fields: streamck.plan.moe.layout.Family).

Every ``model_type`` of transformers 5.19 whose experts run fused (``@use_experts_implementation``)
is a row here, each checked against transformers' own ``save_pretrained`` and load
(tests/test_moe_families.py), except those in ``REFUSED``: save_pretrained renames much of the
rest of their model too (their whole-model mapping in ``conversion_mapping.py``), which is no
expert layout; they are refused in one line rather than written half renamed.
"""

from __future__ import annotations

from dataclasses import replace

from streamck.plan.moe.layout import COUNT_KEYS, DOWN, GATE_UP, Family

_QE = ("gate_proj", "up_proj", "down_proj")
_MIX = ("w1", "w3", "w2")
_BIAS = ("e_score_correction_bias",)  # DeepSeek-V3's routing bias, float32 whatever the load dtype
_INDEXER = ("indexer.weights_proj",)
_QWEN = Family("mlp", "mlp", _QE, "gate.weight")
_DSV3 = replace(_QWEN, fp32=_BIAS)
_MIXTRAL = Family("mlp", "block_sparse_moe", _MIX, "gate.weight")
_GRANITE = Family(
    "block_sparse_moe",
    "block_sparse_moe",
    None,
    "router.weight",
    (
        (f"experts.{GATE_UP}", "input_linear.weight"),
        (f"experts.{DOWN}", "output_linear.weight"),
        ("router.weight", "router.layer.weight"),
    ),
)
_FUSED = Family("mlp", "mlp", None, "gate.weight")  # on disk as at run time
_ARIA = replace(
    _FUSED,
    router="router.weight",
    renames=((f"experts.{GATE_UP}", "experts.fc1.weight"), (f"experts.{DOWN}", "experts.fc2.weight")),
)

# model_type -> layout (transformers' _MODEL_TO_CONVERSION_PATTERN maps many types onto these).
FAMILIES: dict[str, Family] = {
    # Per expert, Qwen2-MoE's names (mlp.experts.e.gate_proj / up_proj / down_proj).
    **dict.fromkeys(
        ("qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text", "qwen4_exp", "qwen4_exp_text"),
        _QWEN,
    ),
    **dict.fromkeys(("olmoe", "flex_olmo", "deepseek_v2", "cohere2_moe", "mellum", "qwen3_omni_moe_thinker"), _QWEN),
    **dict.fromkeys(("deepseek_v3", "glm4_moe", "glm4_moe_lite", "glm4v_moe", "solar_open", "dots1"), _DSV3),
    **dict.fromkeys(("deepseek_v32", "glm_moe_dsa"), replace(_DSV3, fp32_fp16=_INDEXER)),
    "axk2": replace(  # its gated norms' low-rank MLP and its fused query/gate projection, as its files name them
        _DSV3,
        fp32_fp16=_INDEXER,
        names=(("mlp.fc1.", "W_down."), ("mlp.fc2.", "W_up."), ("self_attn.q_gate_proj.", "self_attn.q_b_proj.")),
    ),
    "axk1": replace(_DSV3, names=(("mlp.post_mlp_layernorm", "post_mlp_layernorm"),)),
    "mimo_v2_flash": replace(_DSV3, names=(("self_attn.sinks", "self_attn.attention_sink_bias"),)),
    "exaone_moe": replace(_DSV3, renames=(("gate.e_score_correction_bias", "e_score_correction_bias"),)),
    "hy_v3": replace(
        _DSV3,
        renames=(("gate.weight", "router.gate.weight"), ("e_score_correction_bias", "expert_bias")),
        names=(("mlp.shared_experts.", "mlp.shared_mlp."),),
    ),
    "laguna": replace(
        _QWEN,
        renames=(("gate.e_score_correction_bias", "experts.e_score_correction_bias"),),
        names=(("mlp.shared_experts.", "mlp.shared_expert."),),
    ),
    "afmoe": replace(
        _QWEN,
        router="router.gate.weight",
        fp32_fp16=(
            "input_layernorm",
            "post_attention_layernorm",
            "pre_mlp_layernorm",
            "post_mlp_layernorm",
            "q_norm",
            "k_norm",
            "norm",
            "expert_bias",
        ),
    ),
    "longcat_flash": replace(
        _QWEN,
        router="router.classifier.weight",
        router_extra=("zero_expert_num",),
        gate_up_extra=True,
        fp32_fp16=("classifier.weight",),
    ),
    "hunyuan_v1_moe": replace(_QWEN, router="gate.wg.weight"),
    "ernie4_5_moe": replace(
        _QWEN,
        renames=(("gate.moe_statics.e_score_correction_bias", "moe_statics.e_score_correction_bias"),),
        fp32=("gate.weight", "moe_statics"),
    ),
    "jamba": Family("feed_forward", "feed_forward", _QE, "router.weight"),
    # Per expert, Mixtral's names (block_sparse_moe.experts.e.w1 / w3 / w2).
    **dict.fromkeys(("mixtral", "minimax", "minimax_m2"), _MIXTRAL),
    "phimoe": replace(_MIXTRAL, router="router.weight", renames=(("router.weight", "gate.weight"),)),
    "lfm2_moe": Family("feed_forward", "feed_forward", _MIX, "gate.weight"),
    # Fused on disk, renamed (Granite-MoE: input_linear / output_linear; Aria: experts.fc1 / fc2).
    **dict.fromkeys(("granitemoe", "granitemoeshared", "granitemoehybrid"), _GRANITE),
    "aria_text": _ARIA,
    "aria": replace(  # and the language model under language_model.model, the rest of the model at the root
        _ARIA,
        names=(
            ("model.language_model.", "language_model.model."),
            ("lm_head.", "language_model.lm_head."),
            ("model.multi_modal_projector.", "multi_modal_projector."),
            ("model.vision_tower.", "vision_tower."),
        ),
    ),
    # Fused on disk as at run time (gpt-oss: gate/up interleaved, [E, H, 2I]; Llama 4: [E, H, 2I]).
    "gpt_oss": replace(
        _FUSED, router="router.weight", fp32_fp16=("post_attention_layernorm", "input_layernorm", "norm")
    ),
    **dict.fromkeys(("llama4", "llama4_text"), Family("feed_forward", "feed_forward", None, "router.weight")),
    **dict.fromkeys(("qwen3_vl_moe", "mistral4", "minimax_m3_vl_text"), _FUSED),
    **dict.fromkeys(("gemma4", "gemma4_text"), Family("", "", None, "router.proj.weight")),
    "zaya": replace(_FUSED, router="gate.router_mlp.out_proj.weight", router_extra=(1,)),  # a no-op expert's row
    "granitemoe_swa": Family("block_sparse_moe", "block_sparse_moe", None, "router.weight"),
    "inkling_text": replace(
        _FUSED, router_extra=("n_shared_experts",), fp32=("attn_sconv", "mlp_sconv", "k_sconv", "v_sconv")
    ),
}

# model_type -> why its experts are not rewritten (refused in one line, --keep-fused writes them as they are).
REFUSED: dict[str, str] = {
    "deepseek_v4": "save_pretrained renames most of the model (attn, ffn, norms, hc_*) by regular expression",
    "kimi_linear": "save_pretrained also splits the attention's stacked conv1d weights",
    "hy_v4": "save_pretrained renames its hyper-connection tensors (hc_pre.*) and gates (linear_gate) too",
    "minimax_m3_vl": "save_pretrained rebuilds its vision tower's names (vision_model, patch_merge_mlp)",
    "step3p7": "save_pretrained rebuilds its vision model's names (transformer.resblocks, vit_large_projector)",
    "deepseek_ocr2": "save_pretrained renames its vision encoders by regular expression (sam_model.blocks.N …)",
    "diffusion_gemma": "not checked: its model (a text diffusion model on Gemma 4) builds from no small config here",
    "ernie4_5_vl_moe": "save_pretrained writes its text and vision experts as one list, transposed",
    "glm5_next": "save_pretrained also splits the attention's stacked conv1d weights",
    "inkling_mm_model": "its files interleave gate and up rows (w13_weight) and rename most of the model",
    "nemotron_h": "save_pretrained renames the whole model (model. -> backbone.) and its experts have no gate",
}


def family_of(model_type: str | None) -> Family | None:
    """The layout for ``model_type`` (config.json's), or None when there is no known one."""
    return FAMILIES.get(model_type) if isinstance(model_type, str) else None


def expert_count(config: dict) -> int | None:
    """The routed expert count a config states (COUNT_KEYS), or None."""
    for key in COUNT_KEYS:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


__all__ = ["DOWN", "FAMILIES", "GATE_UP", "REFUSED", "Family", "expert_count", "family_of"]
