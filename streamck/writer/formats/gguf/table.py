"""The GGUF families as data: which Hugging Face architecture becomes which llama.cpp one, how
its tensors are rewritten, and which ``config.json`` values become which GGUF keys.

Every row restates what llama.cpp's ``convert_hf_to_gguf.py`` (as vendored by llama-cpp-python
0.3.36: ``conversion/base.py`` ``TextModel``, ``conversion/llama.py`` ``LlamaModel``,
``conversion/qwen.py`` ``Qwen3Model``) does for that family; the names of the GGUF keys and
tensors are gguf-py's (``gguf.Keys``, ``TensorNameMap``), looked up by the writer method or
``MODEL_ARCH`` member named here, never retyped.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """One architecture's conversion. ``arch`` is the ``gguf.MODEL_ARCH`` member's name;
    ``permute_qk`` says whether q_proj/k_proj rows are reordered from Hugging Face's rotate-half
    RoPE layout to GGML's interleaved one (``LlamaModel.permute``); ``vocab_size_key`` and
    ``rope_dims_key`` whether ``llama.vocab_size`` and ``llama.rope.dimension_count`` follow the
    generic parameters (``LlamaModel.set_gguf_parameters``)."""

    arch: str
    permute_qk: bool
    vocab_size_key: bool
    rope_dims_key: bool


# Hugging Face ``architectures[0]`` -> its family. Others are refused by name.
FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family("LLAMA", permute_qk=True, vocab_size_key=True, rope_dims_key=True),
    "Qwen3ForCausalLM": Family("QWEN3", permute_qk=False, vocab_size_key=False, rope_dims_key=False),
}

# TextModel.set_gguf_parameters's first rows, in its order: the GGUFWriter method and the
# config keys it reads (the first present wins; none present: no key written).
PARAMS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("add_context_length", ("max_position_embeddings", "n_ctx", "n_positions", "max_length",
                            "max_sequence_length", "model_max_length")),
    ("add_embedding_length", ("hidden_size", "n_embd", "dim")),
    ("add_feed_forward_length", ("prefix_dense_intermediate_size", "dense_intermediate_size",
                                 "intermediate_size", "n_inner", "hidden_dim")),
    ("add_head_count", ("num_attention_heads", "n_head", "n_heads")),
    ("add_head_count_kv", ("num_key_value_heads", "n_kv_heads")),
)  # fmt: skip
BLOCK_COUNT = ("n_layers", "num_hidden_layers", "n_layer", "num_layers")
ROPE_THETA = ("global_rope_theta", "rope_global_theta", "rope_theta_global", "rope_theta", "rotary_emb_base")
LOCAL_ROPE_THETA = (
    "local_rope_theta",
    "rope_local_theta",
    "rope_theta_local",
    "swa_rope_theta",
    "rope_local_base_freq",
)
RMS_EPS = ("rms_norm_eps", "norm_eps")
NORM_EPS = ("layer_norm_eps", "layer_norm_epsilon", "norm_epsilon")
# Keys the generic parameters would turn into MoE, RoPE-scaling or pooling keys this slice does
# not write: a config holding one is refused rather than converted differently.
UNSUPPORTED = ("num_local_experts", "num_experts", "n_routed_experts", "mrope_section", "classifier_pooling")

# Tensors the reference skips (ModelBase.prepare_tensors: "we don't need these").
SKIPPED_SUFFIXES = (".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq")

# --outtype -> gguf.LlamaFileType member; "auto" is decided by the first 2-D tensor's dtype.
FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0"}
GGML_DTYPES = {"F32": "F32", "F16": "F16", "BF16": "BF16"}  # safetensors dtype -> GGMLQuantizationType

# TextModel.get_vocab_base_pre: the text whose token ids' sha256 names the BPE pre-tokenizer,
# and the hashes of the families this table holds (convert_hf_to_gguf_update.py made them from
# the models named). A tokenizer whose hash is not here is refused, as the reference does.
CHKTXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 "
    "3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ "
    "------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, "
    "'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)
PRE_TOKENIZERS = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # meta-llama/Meta-Llama-3-8B
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen/Qwen1.5-7B
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",  # Qwen/Qwen3-Embedding-0.6B
}
# TextModel.does_token_look_special: added tokens that are control tokens though not marked special.
LOOKS_SPECIAL = ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
LOOKS_SPECIAL_AROUND = (("<|", "|>"), ("<｜", "｜>"), ("<unused", ">"))
