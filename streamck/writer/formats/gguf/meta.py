"""A GGUF file's key-value pairs, in the order and with the values ``convert_hf_to_gguf.py`` writes.

The reference's ``ModelBase.prepare_metadata`` then ``TextModel.prepare_metadata``: the file's
type, gguf-py's ``Metadata`` (names, size label, sampling defaults from the model's folder), the
model's parameters (``set_gguf_parameters``), the quantization version, then the vocabulary
(``_set_vocab_gpt2``: tokens, types, pre-tokenizer, and gguf-py's ``SpecialVocab``). Every key
goes through a ``gguf.GGUFWriter`` method, so its name and value type are gguf-py's.

The reference loads the tokenizer with transformers' ``AutoTokenizer``; this module reads the
same ``tokenizer.json`` with the ``tokenizers`` library transformers runs it with.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import gguf

from streamck.errors import PlanError
from streamck.writer.formats.gguf import mla, spm, table
from streamck.writer.formats.gguf.compat import SpecialVocab, load_metadata, tokenizer_json
from streamck.writer.formats.gguf.rope import is_llama3


def find(hparams: dict[str, Any], keys: tuple[str, ...]) -> Any:
    """The value of the first of ``keys`` in ``hparams`` (the reference's ``find_hparam``), or None."""
    return next((hparams[k] for k in keys if k in hparams), None)


def add_model_keys(
    w: gguf.GGUFWriter, family: table.Family, hparams: dict[str, Any], model_dir: Path, ftype: int
) -> None:
    """Every key after ``general.architecture``, in the reference's order, into ``w`` (whose
    tensor infos are already added: the size label counts their parameters)."""
    total, shared, expert, count = w.get_total_parameter_count()
    metadata = load_metadata(model_dir, total)
    if metadata.name is None:
        metadata.name = model_dir.name
    if metadata.size_label is None and total > 0:
        metadata.size_label = gguf.size_label(total, shared, expert, count)
    w.add_type(gguf.GGUFType.MODEL)
    metadata.set_gguf_meta_model(w)
    add_parameters(w, family, hparams, ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_vocab(w, family, hparams, model_dir)


def rope_parameters(hparams: dict[str, Any]) -> dict[str, Any]:
    """``TextModel.__init__``'s RoPE parameters: the config's ``rope_parameters`` (or
    ``rope_scaling``) with the top-level theta and type mirrored in."""
    rope = dict(hparams.get("rope_parameters", hparams.get("rope_scaling")) or {})
    theta, local = find(hparams, table.ROPE_THETA), find(hparams, table.LOCAL_ROPE_THETA)
    if "full_attention" not in rope and "sliding_attention" not in rope:
        if local is not None:
            rope["sliding_attention"] = {"rope_theta": local}
        if "rope_theta" not in rope and theta is not None:
            rope["rope_theta"] = theta
        if "rope_type" not in rope and (kind := rope.get("type")) is not None:
            rope["rope_type"] = kind
    return rope


def add_parameters(w: gguf.GGUFWriter, family: table.Family, hparams: dict[str, Any], ftype: int) -> None:
    """``TextModel.set_gguf_parameters``, then the family's own keys (the config checked first
    by ``check_parameters``). Llama 3's RoPE scaling writes no key: it is the ``rope_freqs``
    tensor (streamck.writer.formats.gguf.rope). DeepSeek's MLA adds its own (streamck.writer.formats.gguf.mla)."""
    if family.mla:
        hparams = mla.key_hparams(hparams)
    w.add_block_count(find(hparams, table.BLOCK_COUNT))
    for method, keys in table.PARAMS:
        if (value := find(hparams, keys)) is not None:
            getattr(w, method)(value)
    if hparams.get("is_causal") is False:
        w.add_causal_attention(False)
    rope = rope_parameters(hparams)
    params = rope.get("full_attention", rope)
    if family.yarn and params.get("rope_type") == "yarn" and params.get("factor") is not None:
        add_yarn(w, params)
    elif params.get("rope_type") not in (None, "default") and not (family.rope_freqs and is_llama3(params)):
        raise PlanError(f"RoPE type {params['rope_type']!r}: GGUF output does not write it yet")
    if (theta := params.get("rope_theta")) is not None:
        w.add_rope_freq_base(theta)
    if (local := rope.get("sliding_attention", {}).get("rope_theta")) is not None:
        w.add_rope_freq_base_swa(local)
    if (eps := find(hparams, table.RMS_EPS)) is not None:
        w.add_layer_norm_rms_eps(eps)
    if (eps := find(hparams, table.NORM_EPS)) is not None:
        w.add_layer_norm_eps(eps)
    for method, keys in table.MOE_PARAMS:
        if (value := find(hparams, keys)) is not None:
            getattr(w, method)(value)
    if family.mla:
        mla.add_gating(w, hparams)
    if (head_dim := hparams.get("head_dim")) is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_file_type(ftype)
    if family.vocab_size_key:
        w.add_vocab_size(hparams["vocab_size"])
    if family.rope_dims_key:
        w.add_rope_dimension_count(hparams.get("head_dim") or hparams["hidden_size"] // hparams["num_attention_heads"])
    for method, keys in family.params:
        if (value := find(hparams, keys)) is not None:
            getattr(w, method)(value)
    if family.mla:
        mla.add_parameters(w, hparams)


def add_yarn(w: gguf.GGUFWriter, params: dict[str, Any]) -> None:
    """``TextModel.set_gguf_parameters``'s YaRN keys, in its order (``rope_type`` ``yarn`` with a ``factor``)."""
    if "original_max_position_embeddings" not in params:
        raise PlanError("config.json's YaRN RoPE scaling has no original_max_position_embeddings")
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(params["factor"])
    w.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
    if (ext := params.get("extrapolation_factor")) is not None:
        w.add_rope_scaling_yarn_ext_factor(ext)
    if (attn := params.get("attention_factor", params.get("attn_factor"))) is not None:
        w.add_rope_scaling_yarn_attn_factor(attn)
    if (fast := params.get("beta_fast")) is not None:
        w.add_rope_scaling_yarn_beta_fast(fast)
    if (slow := params.get("beta_slow")) is not None:
        w.add_rope_scaling_yarn_beta_slow(slow)


def check_parameters(family: table.Family, hparams: dict[str, Any]) -> None:
    """Refuse a config this slice would convert otherwise than the reference: one with keys it
    does not write (table.UNSUPPORTED), or experts in a family converted as a dense model."""
    refused = [k for k in table.UNSUPPORTED if k in hparams and not (family.mla and k in mla.GATING)]
    if family.mla:
        mla.check(hparams)
    if family.experts is None and not family.gptoss and find(hparams, table.EXPERT_COUNT) is not None:
        refused.append(next(k for k in table.EXPERT_COUNT if k in hparams))
    if family.arch == "LLAMA" and hparams.get("vocab_size") == table.CODELLAMA_VOCAB:
        refused.append(f"vocab_size {table.CODELLAMA_VOCAB} (CodeLlama's infill tokens)")
    if refused:
        raise PlanError(f"config.json has {', '.join(refused)}: GGUF output does not write that yet")


def check_tokenizer(model_dir: Path, family: table.Family) -> str:
    """How the reference reads the vocabulary: ``"spm"`` (``tokenizer.model``, for a family that
    tries SentencePiece first) or ``"bpe"`` (``tokenizer.json``); a PlanError where it would read
    it another way (a byte-fallback Llama 2 BPE without its tokenizer.model), not written yet."""
    if (model_dir / "tokenizer.model").is_file():
        if family.sentencepiece:
            return "spm"
        raise PlanError(f"a SentencePiece tokenizer (tokenizer.model) for {family.arch}: GGUF output does not write it")
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise PlanError(f"GGUF output needs the model's tokenizer.json, and {model_dir} has none")
    data = tokenizer_json(path)  # parsed once: the header's vocabulary reads it again
    model = data.get("model", {})
    if model.get("type") != "BPE":
        raise PlanError(f"a {model.get('type')} tokenizer: GGUF output writes BPE vocabularies only")
    llama3 = model.get("ignore_merges", False) and not model.get("byte_fallback", True)
    if not llama3 and model.get("byte_fallback", False) and (data.get("decoder") or {}).get("type") == "Sequence":
        raise PlanError("a byte-fallback (Llama 2 style) BPE tokenizer: GGUF output does not write it yet")
    return "bpe"


def add_vocab(w: gguf.GGUFWriter, family: table.Family, hparams: dict[str, Any], model_dir: Path) -> None:
    """``LlamaModel.set_vocab`` / ``Qwen2Model.set_vocab``: SentencePiece (``_set_vocab_sentencepiece``)
    or BPE (``_set_vocab_gpt2``), as check_tokenizer finds."""
    kind = check_tokenizer(model_dir, family)
    config = model_dir / "tokenizer_config.json"
    if family.arch == "LLAMA" and config.is_file():
        if (prefix := json.loads(config.read_bytes()).get("add_prefix_space")) is not None:
            w.add_add_space_prefix(prefix)
    if kind == "spm":
        tokens, scores, types = spm.pieces(model_dir, hparams)
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        SpecialVocab(model_dir, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)
    else:
        tokens, types, pre = vocab_base(model_dir, hparams)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        SpecialVocab(model_dir, load_merges=True).add_to_gguf(w, quiet=True)
    if family.arch == "LLAMA" and hparams.get("vocab_size", 32000) == 49152:  # the reference's granite rule
        w.add_add_bos_token(False)


def vocab_base(model_dir: Path, hparams: dict[str, Any]) -> tuple[list[str], list[int], str]:
    """``TextModel.get_vocab_base``: every id's token (``[PADi]`` for ids the tokenizer lacks),
    its type, and the pre-tokenizer's name."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    vocab = tok.get_vocab(with_added_tokens=True)
    size = hparams.get("vocab_size", len(vocab))
    if max(vocab.values()) >= size:
        raise PlanError(f"the tokenizer has token id {max(vocab.values())}, outside vocab_size {size}")
    pre = pre_tokenizer(tok)
    reverse = {i: t for t, i in vocab.items()}
    added = tok.get_added_tokens_decoder()
    tokens, types = [], []
    for i in range(size):
        token = reverse.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        if i in added:
            if not added[i].normalized:
                token = tok.decode(tok.encode(token, add_special_tokens=False).ids, skip_special_tokens=False)
            if added[i].special or table.looks_special(token):
                types.append(gguf.TokenType.CONTROL)
            else:
                token = token.replace("\u2581", " ")
                types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    return tokens, types, pre


def pre_tokenizer(tok) -> str:
    """The pre-tokenizer's name, from the sha256 of the ids of table.CHKTXT (``get_vocab_base_pre``)."""
    ids = tok.encode(table.CHKTXT).ids
    digest = hashlib.sha256(str(ids).encode()).hexdigest()
    if digest not in table.PRE_TOKENIZERS:
        names = ", ".join(sorted(set(table.PRE_TOKENIZERS.values())))
        raise PlanError(f"the tokenizer's BPE pre-tokenizer is not one GGUF output knows ({names}; chkhsh {digest})")
    return table.PRE_TOKENIZERS[digest]
