"""The MLX families and quantization schemes as data, each row restating mlx-lm 0.32.2.

A family is a ``config.json`` ``model_type`` that ``mlx_lm.models.<model_type>`` loads: the
tensors its ``Model.sanitize`` drops, the experts it stacks into ``switch_mlp`` (and under which
names), the modules its ``quant_predicate`` quantizes otherwise, and the order of its parameters
(``tree_flatten(model.parameters())``: ``mlx_lm.utils.save_model`` cuts shards in that order).
"""

from __future__ import annotations

from dataclasses import dataclass

_ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_QK_NORM = ("self_attn.q_norm", "self_attn.k_norm")
_MLP = ("mlp.gate_proj", "mlp.down_proj", "mlp.up_proj")
_NORMS = ("input_layernorm", "post_attention_layernorm")
_SWITCH = ("gate_proj", "up_proj", "down_proj")  # SwitchGLU's order


@dataclass(frozen=True)
class Family:
    """One ``model_type``. ``dropped`` are name fragments ``sanitize`` removes (``lm_head.weight``
    goes too where ``tie_word_embeddings`` holds); ``block`` the MoE block (``mlp``,
    ``block_sparse_moe``) whose ``experts.<e>.<disk>.weight`` are stacked into
    ``switch_mlp.<name>.weight`` by ``stacks`` (disk name, switch_mlp name); ``predicate`` maps
    a module's name ending to the quantization its ``quant_predicate`` gives it instead of the
    scheme's; ``layer`` is a decoder layer's modules in parameter order (dense ones and MoE ones);
    ``fused``: its experts are stored fused and split as its sanitize splits them
    (streamck.writer.formats.mlx.gptoss); ``norm_first``: ``model.norm`` comes before the layers
    in parameter order (its model sets it first)."""

    dropped: tuple[str, ...] = ()
    block: str = ""
    stacks: tuple[tuple[str, str], ...] = ()
    predicate: tuple[tuple[str, dict], ...] = ()
    layer: tuple[str, ...] = (*_ATTN, *_MLP, *_NORMS)
    fused: bool = False
    norm_first: bool = False


FAMILIES: dict[str, Family] = {
    "llama": Family(dropped=("self_attn.rotary_emb.inv_freq",)),
    "qwen3": Family(layer=(*_ATTN, *_QK_NORM, *_MLP, *_NORMS)),
    "qwen3_moe": Family(
        block="mlp",
        stacks=(("up_proj", "up_proj"), ("down_proj", "down_proj"), ("gate_proj", "gate_proj")),
        predicate=(("mlp.gate", {"group_size": 64, "bits": 8}),),
        layer=(*_ATTN, *_QK_NORM, *_NORMS, "mlp.gate", *(f"mlp.switch_mlp.{p}" for p in _SWITCH), *_MLP),
    ),
    "mixtral": Family(
        block="block_sparse_moe",
        stacks=(("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")),
        layer=(*_ATTN, "block_sparse_moe.gate", *(f"block_sparse_moe.switch_mlp.{p}" for p in _SWITCH), *_NORMS),
    ),
    "gpt_oss": Family(  # self_attn's own parameter (sinks) first, the experts in SwitchGLU's order
        predicate=(("mlp.router", {"group_size": 64, "bits": 8}),),
        layer=("self_attn", *_ATTN, *(f"mlp.experts.{p}" for p in _SWITCH), "mlp.router", *_NORMS),
        fused=True,
        norm_first=True,
    ),
}


@dataclass(frozen=True)
class Scheme:
    """A ``--quantize`` scheme: ``mlx_lm.convert -q`` with ``--q-mode mode``, and its default
    ``--q-group-size`` and ``--q-bits`` (``quantize_model``'s ``defaults_for_mode``)."""

    mode: str
    group: int
    bits: int


SCHEMES: dict[str, Scheme] = {
    "mlx_q4": Scheme("affine", 64, 4),  # -q
    "mlx_q8": Scheme("affine", 64, 8),  # -q --q-bits 8
    "mlx_mxfp4": Scheme("mxfp4", 32, 4),  # -q --q-mode mxfp4
    "mlx_nvfp4": Scheme("nvfp4", 16, 4),  # -q --q-mode nvfp4
    "mlx_mxfp8": Scheme("mxfp8", 32, 8),  # -q --q-mode mxfp8
}
# the group sizes mx.quantize takes in each mode
GROUPS = {"affine": (32, 64, 128), "mxfp4": (32,), "nvfp4": (16,), "mxfp8": (32,)}

# --dtype as mlx_lm.convert's (MODEL_CONVERSION_DTYPES) and config.json's torch_dtype spell them.
DTYPES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}
MAX_SHARD = 5 << 30  # mlx_lm.utils.MAX_FILE_SIZE_GB
# What save() writes beside the weights besides the config: the tokenizer's files (its
# save_pretrained), the model's code and generation_config.json (copied).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
# create_model_card for a local source: a card from the template with mlx's fields.
README = b"---\nlanguage: en\nlibrary_name: mlx\npipeline_tag: text-generation\ntags:\n- mlx\n---\n"
