"""Tiny transformers MoE models of each family in FAMILIES, built from a config, for the MoE tests.

``tiny_config(model_type)`` is a config of 2 layers, 4 experts and hidden size 16 (SPECS: what a
family needs beyond its defaults cut down) whose sizes
make every per-expert slice distinct (gate/up rows [I, H] with I != H); ``logits`` runs a model
on fixed tokens.
"""

from __future__ import annotations

VOCAB = 64
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
_MLA = dict(num_key_value_heads=2, head_dim=4, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4)
_MLA["v_head_dim"] = 4
# model_type -> the config fields that make it an MoE of 4 experts (first_k_dense_replace=1: one dense layer).
_SHARED = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=12)
_GEMMA4 = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=12, global_head_dim=8)
SPECS = {
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8),
    "qwen2_moe": _SHARED,
    "qwen3_next": _SHARED,
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "minimax": dict(num_local_experts=4, num_experts_per_tok=2),
    "phimoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "deepseek_v3": dict(
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        **_MLA,
    ),
    "deepseek_v2": dict(
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
        n_shared_experts=1,
        first_k_dense_replace=1,
        **_MLA,
    ),
    "glm4_moe": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, first_k_dense_replace=1),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "hunyuan_v1_moe": dict(num_experts=4, moe_topk=2),
    "ernie4_5_moe": dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=8),
    "jamba": dict(num_experts=4, num_experts_per_tok=2),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2),
    "llama4_text": dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=24),
    "dots1": dict(
        n_routed_experts=4, num_local_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1
    ),
    "glm4v_moe": dict(text_config=dict(head_dim=128)),  # its mrope sections cover 64 rotary dims
    "lfm2_moe": dict(num_experts=4, layer_types=["conv", "full_attention"], num_dense_layers=1),
    "longcat_flash": dict(
        n_routed_experts=4, zero_expert_num=2, expert_ffn_hidden_size=12, qk_head_dim=8, moe_topk=2, **_MLA
    ),
    **dict.fromkeys(("axk1", "axk2", "deepseek_v32", "glm_moe_dsa", "glm4_moe_lite", "mistral4"), _MLA),
    "gemma4_text": _GEMMA4,
    "gemma4": dict(text_config=_GEMMA4, tie_word_embeddings=False),
    "zaya": dict(num_experts_per_tok=1, router_hidden_size=8),
    "granitemoehybrid": dict(mamba_n_heads=4, mamba_d_head=8, mamba_expand=2),
}


# The sizes a family's default config is cut down to, wherever it has the field (nested ones too).
SMALL = dict(
    COMMON,
    moe_intermediate_size=12,
    shared_expert_intermediate_size=20,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    moe_num_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    num_layers=2,
    # The towers of the multimodal families (audio, vision, Gemma 4's per-layer embeddings): left at their
    # defaults they made 5 GiB of saves, as much disk and time as every other family together.
    d_model=16,
    encoder_ffn_dim=24,
    encoder_attention_heads=2,
    output_dim=16,
    downsample_hidden_size=8,
    out_hidden_size=16,
    vision_output_dim=16,
    projector_input_dim=16,
    projector_output_dim=16,
    vocab_size_per_layer_input=VOCAB,
    hidden_size_per_layer_input=8,
    **_MLA,
)
# What a config derives from other fields (per-layer lists for the default depth, DeepSeek's qk_head_dim,
# Ernie's moe_layer_end_index, Jamba's mamba_dt_rank): dropped, so that it derives them for the small sizes.
_DERIVED = ("layer_types", "mlp_layer_types", "layers_block_type", "mlp_only_layers", "no_rope_layers", "moe_layers")
_DERIVED += ("num_attention_heads_per_layer", "per_layer_config", "qk_head_dim", "moe_layer_end_index", "mamba_dt_rank")


def _shrink(d: dict) -> dict:
    for key, value in list(d.items()):
        if key in _DERIVED:
            del d[key]
        elif isinstance(value, dict):
            _shrink(value)
        elif key in SMALL and isinstance(value, int) and not isinstance(value, bool):
            d[key] = SMALL[key]
    return d


def tiny_config(model_type: str, **extra):
    """A small config of ``model_type``: its defaults cut to SMALL's sizes, then SPECS' fields."""
    from transformers import AutoConfig

    base = AutoConfig.for_model(model_type).to_dict()
    for key in ("model_type", "transformers_version", "architectures"):
        base.pop(key, None)
    common = {} if "text_config" in base else COMMON  # a multimodal family: its text_config is cut down
    fields = {**_shrink(base), **common}
    for key, value in {**SPECS.get(model_type, {}), **extra}.items():
        fields[key] = (
            {**fields[key], **value} if isinstance(value, dict) and isinstance(fields.get(key), dict) else value
        )
    return AutoConfig.for_model(model_type, **fields)


def model_class(config):
    """The transformers class that runs ``config`` as a language model (a causal LM, or the
    image-text-to-text model of a multimodal family)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    multimodal = hasattr(config, "text_config")
    for auto in (AutoModelForImageTextToText, AutoModelForCausalLM)[:: 1 if multimodal else -1]:
        if type(config) in auto._model_mapping:
            return auto._model_mapping[type(config)]
    raise KeyError(f"{config.model_type}: no causal-LM or image-text-to-text class")


def tiny_model(model_type: str, seed: int = 0):
    """A randomly initialised causal LM of ``model_type`` (fp32), every parameter perturbed so
    that no two experts (nor any zero-initialised bias) are alike."""
    import torch

    torch.manual_seed(seed)
    config = tiny_config(model_type)
    model = model_class(config)(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def logits(model):
    import torch

    ids = (torch.arange(24).reshape(2, 12) * 7 + 3) % VOCAB
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def runtime_save(model, d):
    """What a trainer saving ``model.state_dict()`` leaves in ``d``: the runtime names, config.json beside."""
    from safetensors.torch import save_file

    d.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, d / "model.safetensors")
    model.config.save_pretrained(d)
    return d


class Saves:
    """tiny_model of each family with its save_pretrained folder (``hf``) and a trainer's runtime save
    (``runtime``), each made once, on first use, under ``root``: the tests that only read them share
    one (tests/conftest.py ``moe_saves``); a test that changes a file makes its own."""

    def __init__(self, root):
        self.root, self.models = root, {}

    def model(self, model_type: str):
        if model_type not in self.models:
            self.models[model_type] = tiny_model(model_type)
        return self.models[model_type]

    def hf(self, model_type: str):
        d = self.root / model_type / "hf"
        if not d.exists():
            self.model(model_type).save_pretrained(d.with_name("hf.partial"))  # renamed when whole
            d.with_name("hf.partial").rename(d)
        return d

    def runtime(self, model_type: str):
        d = self.root / model_type / "runtime"
        if not d.exists():
            d.parent.mkdir(exist_ok=True)
            runtime_save(self.model(model_type), d.with_name("runtime.partial")).rename(d)
        return d
