"""The GGUF families as data: which Hugging Face architecture becomes which llama.cpp one, how
its tensors are rewritten, and which ``config.json`` values become which GGUF keys.

Every row restates what llama.cpp's ``convert_hf_to_gguf.py`` (as vendored by llama-cpp-python
0.3.36: ``conversion/base.py`` ``TextModel``, ``conversion/llama.py`` ``LlamaModel`` (Mistral and
Mixtral too; its ``rope_freqs`` tensor in streamck.writer.formats.gguf.rope), ``conversion/qwen.py``
``Qwen3Model`` and ``Qwen3MoeModel``, ``conversion/gpt_oss.py`` ``GptOssModel``: its own tensors in
streamck.writer.formats.gguf.gptoss) does for that family;
the names of the GGUF keys and tensors are gguf-py's (``gguf.Keys``, ``TensorNameMap``), looked up
by the writer method or ``MODEL_ARCH`` member named here, never retyped.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """One architecture's conversion. ``arch`` is the ``gguf.MODEL_ARCH`` member's name;
    ``permute_qk`` says whether q_proj/k_proj rows are reordered from Hugging Face's rotate-half
    RoPE layout to GGML's interleaved one (``LlamaModel.permute``); ``vocab_size_key`` and
    ``rope_dims_key`` whether ``llama.vocab_size`` and ``llama.rope.dimension_count`` follow the
    generic parameters (``LlamaModel.set_gguf_parameters``); ``sentencepiece`` whether its
    ``set_vocab`` reads a ``tokenizer.model`` first, where there is one; ``experts`` is its MoE layout
    (None: a dense model); ``params`` the keys its own ``set_gguf_parameters`` adds after the
    generic ones, as PARAMS's rows; ``rope_freqs`` whether Llama 3's RoPE scaling (``rope_type``
    ``llama3``) becomes the ``rope_freqs`` tensor (``LlamaModel.generate_extra_tensors``;
    streamck.writer.formats.gguf.rope), else it is refused."""

    arch: str
    permute_qk: bool
    vocab_size_key: bool
    rope_dims_key: bool
    experts: Experts | None = None
    params: tuple[tuple[str, tuple[str, ...]], ...] = ()
    sentencepiece: bool = False
    rope_freqs: bool = False
    mla: bool = False  # DeepSeek's MLA conversion: its tensors and keys (streamck.writer.formats.gguf.mla)
    gptoss: bool = False  # gpt-oss's fused experts and sinks (streamck.writer.formats.gguf.gptoss)
    yarn: bool = False  # writes YaRN RoPE scaling's keys (TextModel.set_gguf_parameters), else refuses it


@dataclass(frozen=True)
class Experts:
    """How the reference stacks a family's per-expert tensors (``Qwen2MoeModel.modify_tensors``,
    ``LlamaModel.modify_tensors``): the per-expert names ``{block}.experts.{e}.{proj}.weight``
    under ``model.layers.{bid}.{block}``; once a layer's ``len(projs)`` x E tensors are all seen,
    each of ``projs`` in this order becomes one [E, rows, cols] tensor named ``stacked`` (its
    Hugging Face-side name, which ``TensorNameMap`` maps)."""

    block: str
    projs: tuple[str, ...]
    stacked: str


# Hugging Face ``architectures[0]`` -> its family. Others are refused by name.
FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(
        "LLAMA", permute_qk=True, vocab_size_key=True, rope_dims_key=True, sentencepiece=True, rope_freqs=True
    ),
    "MistralForCausalLM": Family(
        "LLAMA", permute_qk=True, vocab_size_key=True, rope_dims_key=True, sentencepiece=True, rope_freqs=True
    ),
    "Qwen3ForCausalLM": Family(
        "QWEN3", permute_qk=False, vocab_size_key=False, rope_dims_key=False, sentencepiece=True
    ),
    "Qwen3MoeForCausalLM": Family(
        "QWEN3MOE", permute_qk=False, vocab_size_key=False, rope_dims_key=False,
        experts=Experts("mlp", ("down_proj", "gate_proj", "up_proj"), "model.layers.{bid}.mlp.experts.{proj}.weight"),
        params=(("add_expert_feed_forward_length", ("moe_intermediate_size",)),
                ("add_expert_shared_feed_forward_length", ("shared_expert_intermediate_size",))),
    ),
    "MixtralForCausalLM": Family(
        "LLAMA", permute_qk=True, vocab_size_key=True, rope_dims_key=True,
        experts=Experts("block_sparse_moe", ("w1", "w2", "w3"), "layers.{bid}.feed_forward.experts.{proj}.weight"),
        sentencepiece=True, rope_freqs=True,
    ),
    "DeepseekV3ForCausalLM": Family(
        "DEEPSEEK2", permute_qk=False, vocab_size_key=False, rope_dims_key=False,
        experts=Experts("mlp", ("down_proj", "gate_proj", "up_proj"), "model.layers.{bid}.mlp.experts.{proj}.weight"),
        mla=True, yarn=True,
    ),
    "GptOssForCausalLM": Family(
        "GPT_OSS", permute_qk=False, vocab_size_key=False, rope_dims_key=False, gptoss=True, yarn=True,
        params=(("add_sliding_window", ("sliding_window",)),
                ("add_expert_feed_forward_length", ("intermediate_size",))),
    ),
}  # fmt: skip

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
# The generic parameters' MoE rows, after the norm epsilons, in its order (as PARAMS).
MOE_PARAMS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("add_expert_count", ("num_local_experts", "num_experts", "n_routed_experts")),
    ("add_expert_used_count", ("num_experts_per_tok", "num_experts_per_token", "top_k_experts")),
    ("add_expert_group_count", ("n_group",)),
    ("add_expert_group_used_count", ("topk_group",)),
)
# Keys the generic parameters would turn into routing, RoPE-scaling or pooling keys this slice
# does not write: a config holding one is refused rather than converted differently.
UNSUPPORTED = (
    "score_function", "scoring_func", "score_func", "moe_router_activation", "moe_router_activation_func",
    "expert_selection_fn", "mrope_section", "classifier_pooling",
)  # fmt: skip
# Expert counts: a config stating one is an MoE model, converted only by a family with experts.
EXPERT_COUNT = MOE_PARAMS[0][1]
# prepare_tensors's tensors kept in F32 whatever the file type (the ones these families have).
F32_TENSORS = ("FFN_GATE_INP", "FFN_GATE_INP_SHEXP")

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
    # Xenova/gpt-4o: o200k, which gpt-oss's tokenizer extends with special tokens only (the suite
    # has no o200k vocabulary: its gpt-oss models carry llama-bpe's)
    "ccc2ef013c104be7bae2965776d611e1d7a8a2a9c547dd93a682c9a9fc80352e": "gpt-4o",
}
# TextModel.does_token_look_special: added tokens that are control tokens though not marked special.
LOOKS_SPECIAL = ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
LOOKS_SPECIAL_AROUND = (("<|", "|>"), ("<｜", "｜>"), ("<unused", ">"))
# LlamaModel.set_vocab's CodeLlama rule (infill tokens at fixed ids) applies to this vocab_size: refused.
CODELLAMA_VOCAB = 32016


def looks_special(token: str) -> bool:
    """``TextModel.does_token_look_special``."""
    return token in LOOKS_SPECIAL or any(token.startswith(a) and token.endswith(b) for a, b in LOOKS_SPECIAL_AROUND)
