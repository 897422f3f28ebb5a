"""DeepSeek-V3 to GGUF as the reference converts it (``conversion/deepseek.py`` ``DeepseekV2Model``,
which registers ``DeepseekV3ForCausalLM``): Multi-head Latent Attention and its keys.

Tensors (``modify_tensors``, ``filter_tensors``), described without reading a byte:

- ``kv_b_proj`` [H * (nope + v), kv_lora_rank] becomes two tensors in its place, viewed per head
  as [H, nope + v, kv_lora_rank]: ``k_b_proj``, each head's first ``nope`` rows transposed to
  [H, kv_lora_rank, nope] (a strided view of the source's bytes, gathered in bounded blocks by
  streamck.source.strided), then ``v_b_proj``, each head's last ``v`` rows [H, v, kv_lora_rank]
  (a row selection, streamck.source.select);
- ``mlp.gate.e_score_correction_bias`` is named ``mlp.gate.e_score_correction.bias`` (gguf-py
  maps that one; a ``.bias``, so F32);
- layers past ``num_hidden_layers`` (DeepSeek's multi-token-prediction layer) are left out, and
  ``lm_head.weight`` too where ``tie_word_embeddings`` is set.

Keys (``set_gguf_parameters``): the generic parameters see ``num_key_value_heads`` 1 (MLA runs
as MQA) and ``rms_norm_eps`` 1e-6 where the config has none; the routing function
(``scoring_func`` …) becomes ``expert_gating_func`` after the expert group counts, as the generic
parameters write it; then this family's rows (add_parameters), YaRN's ``mscale_all_dim`` last (as
``0.1 * mscale_all_dim``, the reference's legacy ``yarn_log_mul`` for DeepSeek).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

import gguf

from streamck.errors import PlanError
from streamck.plan import OutputTensor
from streamck.source.header import TensorRef
from streamck.source.select import Rows, concat, select
from streamck.writer.formats.gguf import computed

# TextModel.set_gguf_parameters's routing-function keys (the first present wins) and the values it knows.
GATING = ("score_function", "scoring_func", "score_func", "moe_router_activation", "moe_router_activation_func",
          "expert_selection_fn")  # fmt: skip
GATING_FUNCS = {"sigmoid": "SIGMOID", "softmax": "SOFTMAX"}  # -> gguf.ExpertGatingFuncType member
KV_B = "self_attn.kv_b_proj.weight"
SCORE_BIAS = ("e_score_correction_bias", "e_score_correction.bias")


def _get(hparams: dict[str, Any], keys: tuple[str, ...]) -> Any:
    return next((hparams[k] for k in keys if k in hparams), None)


def key_hparams(hparams: dict[str, Any]) -> dict[str, Any]:
    """The config as ``set_gguf_parameters`` hands it to the generic parameters: one key-value
    head, and an RMS epsilon of 1e-6 where it states none."""
    return {**hparams, "num_key_value_heads": 1, "rms_norm_eps": hparams.get("rms_norm_eps", 1e-6)}


def add_gating(w: gguf.GGUFWriter, hparams: dict[str, Any]) -> None:
    """``expert_gating_func`` from the config's routing function, where it states one; a
    PlanError for a function gguf-py (0.19.0) has no value for."""
    func = _get(hparams, GATING)
    if func is None:
        return
    if func not in GATING_FUNCS:
        raise PlanError(f"config.json's routing function {func!r}: GGUF output writes {', '.join(GATING_FUNCS)}")
    w.add_expert_gating_func(gguf.ExpertGatingFuncType[GATING_FUNCS[func]])


def add_parameters(w: gguf.GGUFWriter, hparams: dict[str, Any]) -> None:
    """``DeepseekV2Model.set_gguf_parameters``'s own keys, after the generic ones, in its order.
    Three of them are written twice, as the reference writes them: a key keeps its first place
    and takes its last value (gguf-py's warning about that is silenced)."""
    quiet = logging.getLogger("gguf.gguf_writer")
    level, quiet.level = quiet.level, logging.ERROR
    try:
        _add_parameters(w, hparams)
    finally:
        quiet.setLevel(level)


def _add_parameters(w: gguf.GGUFWriter, hparams: dict[str, Any]) -> None:
    has_moe = hparams.get("n_routed_experts") is not None
    dense = hparams.get("first_k_dense_replace")
    w.add_leading_dense_block_count(dense if dense is not None else 0 if has_moe else hparams["num_hidden_layers"])
    kv_lora_rank = hparams.get("kv_lora_rank", 512)
    w.add_vocab_size(hparams["vocab_size"])
    if hparams.get("q_lora_rank") is not None:
        w.add_q_lora_rank(hparams["q_lora_rank"])
    w.add_kv_lora_rank(kv_lora_rank)
    w.add_key_length(kv_lora_rank + hparams["qk_rope_head_dim"])
    w.add_value_length(kv_lora_rank)
    w.add_key_length_mla(hparams["qk_nope_head_dim"] + hparams["qk_rope_head_dim"])
    w.add_value_length_mla(hparams["v_head_dim"])
    moe_ff = _get(hparams, ("moe_intermediate_size", "intermediate_size"))
    if moe_ff is None:
        raise PlanError("config.json states neither moe_intermediate_size nor intermediate_size")
    w.add_expert_feed_forward_length(moe_ff)
    if has_moe:
        w.add_expert_count(hparams["n_routed_experts"])
    w.add_expert_shared_count(hparams.get("n_shared_experts", 0))
    if (scale := hparams.get("routed_scaling_factor")) is not None:
        w.add_expert_weights_scale(scale)
    if hparams.get("norm_topk_prob"):
        w.add_expert_weights_norm(hparams["norm_topk_prob"])
    w.add_rope_dimension_count(hparams["qk_rope_head_dim"])
    rope = hparams.get("rope_parameters", hparams.get("rope_scaling")) or {}
    if (mscale_all_dim := rope.get("mscale_all_dim")) is not None:  # YaRN's attention scale, as the reference
        w.add_rope_scaling_yarn_log_mul(0.1 * mscale_all_dim)  # writes it for DeepSeek (not as other families)


def check(hparams: dict[str, Any]) -> None:
    """PlanError where the config lacks a value the keys or the kv_b_proj split need."""
    needs = ("num_hidden_layers", "vocab_size", "num_key_value_heads", "qk_rope_head_dim", "qk_nope_head_dim",
             "v_head_dim")  # fmt: skip
    missing = [k for k in needs if not isinstance(hparams.get(k), int)]
    if missing:
        raise PlanError(f"config.json states no {', '.join(missing)}: DeepSeek's GGUF keys need them")


def rewrite(t: OutputTensor, hparams: dict[str, Any]) -> Iterator[OutputTensor]:
    """``t`` as ``modify_tensors`` / ``filter_tensors`` give it: nothing (an MTP layer, a tied
    lm_head), two (kv_b_proj's split), or itself, the routing bias renamed."""
    parts = t.name.split(".")
    if parts[:2] == ["model", "layers"] and parts[2].isdecimal() and int(parts[2]) >= hparams["num_hidden_layers"]:
        return
    if hparams.get("tie_word_embeddings", False) and t.name in ("lm_head.weight", "model.lm_head.weight"):
        return
    if t.name.endswith(SCORE_BIAS[0]):
        yield dataclasses.replace(t, name=t.name.removesuffix(SCORE_BIAS[0]) + SCORE_BIAS[1])
    elif t.name.endswith(KV_B):
        yield from split_kv_b(t, hparams)
    else:
        yield t


def split_kv_b(t: OutputTensor, hparams: dict[str, Any]) -> tuple[OutputTensor, ...]:
    """``kv_b_proj`` as the reference's ``k_b_proj`` [H, kv_lora_rank, nope] (transposed per
    head) and ``v_b_proj`` [H, v, kv_lora_rank], each a view of the source's bytes (of a
    dequantized kv_b_proj: computed, streamck.writer.formats.gguf.computed)."""
    heads, nope, v = hparams["num_key_value_heads"], hparams["qk_nope_head_dim"], hparams["v_head_dim"]
    ref = t.source
    if len(t.shape) != 2 or t.shape[0] != heads * (nope + v):
        raise PlanError(f"{t.name} is {list(t.shape)}: not num_key_value_heads x (qk_nope_head_dim + v_head_dim) rows")
    cols, k_name, v_name = ref.shape[1], *(t.name.replace("kv_b_proj", p) for p in ("k_b_proj", "v_b_proj"))
    if t.transform is not None:  # a dequantized kv_b_proj: split as it is computed
        return computed.split(t, (k_name, v_name), heads, nope, v)
    try:
        k_b = concat(k_name, [_transposed(ref, k_name, Rows.span(h * (nope + v), h * (nope + v) + nope))
                              for h in range(heads)])  # fmt: skip
        v_b = select(ref, Rows(nope, (heads, v), (nope + v, 1)), name=v_name)
    except ValueError as e:
        raise PlanError(f"{t.name}: {e}") from None
    k_b = k_b._replace(shape=(heads, cols, nope))
    v_b = v_b._replace(shape=(heads, v, cols))
    return OutputTensor(k_name, k_b, t.dtype), OutputTensor(v_name, v_b, t.dtype)


def _transposed(ref: TensorRef, name: str, rows: Rows) -> TensorRef:
    """``ref[rows].T`` as a strided view; ``rows`` must lie contiguously in one file (a plain
    tensor or one block of a sharded one), else a ValueError."""
    block = select(ref, rows, name=name)
    if block.strides is not None or block.tiles is not None or block.parts is not None:
        raise ValueError("its rows of one head are not contiguous in one file (kv_b_proj is split from those only)")
    count, cols = block.shape
    return block._replace(shape=(cols, count), strides=(1, cols))
