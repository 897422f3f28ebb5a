"""A Hugging Face GPT's tensors as megatron-core GPTModel's ``torch_dist`` chunks: the tables of
``--plan megatron-gpt`` (streamck.plan.megatron.layout) run the other way.

Each Megatron key is stacked over layers (leading axis L); one layer's part of it is one or more
chunks, each a row range of one Hugging Face tensor, so that every chunk's bytes are that
tensor's own (copied kernel-side, or cast): ``linear_qkv`` is one chunk per query group for its
query heads, one for its key head and one for its value head (megatron-core's
``get_query_key_value_tensors`` order), ``linear_fc1`` a gate chunk and an up chunk, the
vocabulary the Hugging Face rows and then a chunk of zeros up to the padded size (Megatron-LM's
``--make-vocab-size-divisible-by``). A tensor DCP loads at any TP/PP is read across these chunks.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from streamck.errors import PlanError
from streamck.plan import OutputTensor, hf_export
from streamck.plan.contract import check_shape
from streamck.plan.megatron.layout import DENSE_MLP, HEAD, LAYER, MOE_FAMILIES, POST_ATTN_NORM, QK_NORM, QKV_BIAS, TOP
from streamck.source import TensorRef
from streamck.source.select import Rows, concat, select
from streamck.writer.formats.megatron import moe
from streamck.writer.formats.megatron.dcp import Chunk, Piece

# model_type -> (q/k norms, a qkv bias) for the families whose decoder is megatron-core's GPTModel
# with these tables. Llama's and Qwen3's ``attention_bias`` biases o_proj too, which Megatron's
# --add-qkv-bias does not: their bias tensors are refused as having no place here.
FAMILIES = {
    "llama": (False, False),
    "qwen2": (False, True),
    "qwen3": (True, False),
    "qwen3_moe": (True, False),
    "qwen2_moe": (False, True),
    "mixtral": (False, False),
}
# Config values these tables cannot write (each would need a layout of its own, or Megatron's
# GPTModel computes something else with them).
REFUSED = {
    "mlp_bias": "biases on the MLP",
    "hidden_act": "an activation other than SwiGLU (silu)",
    "sliding_window": "sliding-window attention, which Megatron's GPTModel does not do (it attends over the "
    "whole sequence)",
}
# model_type -> (which layers transformers 5 gives the window when the config has no layer_types:
# "all", "from" max_window_layers on, "even" ones below it; sliding_window's default, the key that
# turns it on). A config's layer_types, where the family reads it, decides alone.
WINDOW = {
    "qwen2": ("from", 4096, "use_sliding_window"),
    "qwen3": ("from", 4096, "use_sliding_window"),
    "qwen2_moe": ("even", 4096, "use_sliding_window"),
    "qwen3_moe": ("all", 4096, "use_sliding_window"),
    "mixtral": ("all", None, None),  # no switch: a non-null sliding_window is on
}
# The linears (and TE's attention) whose per-layer ``_extra_state`` megatron-core saves as a
# ShardedObject; a model built for loading asks for those its layer spec has (local or Transformer
# Engine), and more in the checkpoint are never read.
EXTRA_STATE = ("self_attention.linear_qkv", "self_attention.linear_proj", "self_attention.core_attention",
               "mlp.linear_fc1", "mlp.linear_fc2")  # fmt: skip

# The first axis of a Hugging Face tensor that is some rows of a fused Megatron one.
FIRST = {"q": "nh*d", "k": "nkv*d", "v": "nkv*d", "gate": "I", "up": "I"}


class Model(NamedTuple):
    """What the tables need of the config: the shape symbols and the features."""

    sizes: dict[str, int]
    norms: bool
    bias: bool
    tied: bool
    moe: str | None = None  # the MoE family (its model_type), None for a dense model


def model(config: dict, where: Path) -> Model:
    """The config's family, sizes and features; a PlanError for a family or feature with no table."""
    kind = config.get("model_type")
    if kind not in FAMILIES:
        raise PlanError(f"model_type {kind!r} has no Megatron GPTModel table ({{format}} megatron writes "
                        f"{', '.join(FAMILIES)})", where)  # fmt: skip
    if config.get("mlp_bias"):
        raise PlanError(f"mlp_bias is set: {REFUSED['mlp_bias']}, which {{format}} megatron does not write", where)
    if config.get("hidden_act", "silu") != "silu":
        raise PlanError(f"hidden_act {config['hidden_act']!r}: {REFUSED['hidden_act']}", where)
    norms, bias = FAMILIES[kind]
    sizes = hf_export.sizes(config, where)
    window = _sliding(config, kind, sizes["L"], where)
    if window is not None:
        raise PlanError(f"{window} turns on {REFUSED['sliding_window']}: {{format}} megatron refuses it", where)
    sizes["QKV"] = (sizes["nh"] + 2 * sizes["nkv"]) * sizes["d"]
    family = kind if kind in MOE_FAMILIES else None
    if family is not None:
        sizes |= moe.moe_sizes(config, where)
    return Model(sizes, norms, bias, bool(config.get("tie_word_embeddings", False)), family)


def _sliding(config: dict, kind: str, layers: int, where: Path | None) -> str | None:
    """The config key that gives some layer a sliding attention window, as transformers 5 reads the
    config, or None where no layer has one."""
    types = config.get("layer_types")
    if isinstance(types, list) and "sliding_attention" in types:
        return "layer_types"
    if kind not in WINDOW:
        return None
    which, default, switch = WINDOW[kind]
    if (types is not None and which != "all") or config.get("sliding_window", default) is None:
        return None  # layer_types names no sliding layer, or there is no window
    if switch is not None and not config.get(switch, False):
        return None
    first = config.get("max_window_layers", 28)
    if not isinstance(first, int) or isinstance(first, bool):
        raise PlanError(f"max_window_layers must be an integer, not {first!r}", where)
    applies = {"all": True, "from": first < layers, "even": first > 0}[which]
    return (switch or "sliding_window") if applies else None


def padded_vocab(vocab: int, divisible_by: int) -> int:
    """Megatron-LM's ``_vocab_size_with_padding`` at tensor parallel 1: up to a multiple of ``divisible_by``."""
    return -(-vocab // divisible_by) * divisible_by


def _rows(t: OutputTensor, first: int, stop: int, name: str) -> OutputTensor:
    """Rows [first, stop) of ``t`` as the chunk ``name`` (its source named by the Hugging Face tensor's rows)."""
    return OutputTensor(name, _span(t.source, first, stop, f"{t.name}[{first}:{stop}]"), t.dtype)


def _span(ref: TensorRef, first: int, stop: int, name: str) -> TensorRef:
    """Rows [first, stop) of ``ref``; of a gathered one (a tensor another plan assembled from
    pieces: ``--plan megatron-gpt``'s q_proj, from each query group's rows), those rows of its parts."""
    if ref.parts is None:
        return select(ref, Rows.span(first, stop), name=name)
    out, at = [], 0
    for part in ref.parts:
        lo, hi = max(first, at), min(stop, at + part.shape[0])
        if lo < hi:
            out.append(select(part, Rows.span(lo - at, hi - at), name=name))
        at += part.shape[0]
    return concat(name, out)


def _whole(t: OutputTensor, key: str, shape: tuple[int, ...], layer: int | None) -> Piece:
    at = () if layer is None else (layer,)
    size = () if layer is None else (1,)
    chunk = Chunk(key, t.dtype, shape, (*at, *(0,) * len(t.shape)), (*size, *t.shape))
    return Piece(chunk, OutputTensor(f"{key}[{layer}]" if at else key, t.source, t.dtype))


def _grouped(t: OutputTensor, key: str, kind: str, s: dict[str, int], layer: int) -> list[Piece]:
    """q, k or v rows of one layer, one chunk per query group at its place in ``linear_qkv``."""
    hpg, d = s["nh"] // s["nkv"], s["d"]
    step, rest = (hpg + 2) * d, t.shape[1:]
    n, first = {"q": (hpg * d, 0), "k": (d, hpg * d), "v": (d, (hpg + 1) * d)}[kind]
    shape = (s["L"], s["QKV"], *rest)
    out = []
    for g in range(s["nkv"]):
        at = g * step + first
        chunk = Chunk(key, t.dtype, shape, (layer, at, *(0,) * len(rest)), (1, n, *rest))
        out.append(Piece(chunk, _rows(t, g * n, (g + 1) * n, f"{key}[{layer},{at}]")))
    return out


def _gate_up(t: OutputTensor, key: str, kind: str, s: dict[str, int], layer: int) -> Piece:
    at = 0 if kind == "gate" else s["I"]
    chunk = Chunk(key, t.dtype, (s["L"], 2 * s["I"], s["H"]), (layer, at, 0), (1, s["I"], s["H"]))
    return Piece(chunk, OutputTensor(f"{key}[{layer},{at}]", t.source, t.dtype))


def _vocab(t: OutputTensor, key: str, padded: int) -> list[Piece]:
    rows, hidden = t.shape
    shape = (padded, hidden)
    out = [Piece(Chunk(key, t.dtype, shape, (0, 0), (rows, hidden)), OutputTensor(key, t.source, t.dtype))]
    if padded > rows:  # Megatron's padding rows: zeros, as its own padding of a tokenizer's vocabulary leaves them
        out.append(Piece(Chunk(key, t.dtype, shape, (rows, 0), (padded - rows, hidden)), None))
    return out


def _table(m: Model) -> list[tuple]:
    """One layer's rows: the dense decoder's, with its qkv bias and q/k norms; an MoE layer's
    experts come from moe.py instead of the dense MLP's rows."""
    table = [*LAYER, *(QKV_BIAS if m.bias else ()), *(QK_NORM if m.norms else ())]
    return [r for r in table if not (m.moe and r[1] in DENSE_MLP)]


def _wanted(m: Model, s: dict[str, int]) -> list[tuple[str, tuple[str, ...]]]:
    """Every Hugging Face tensor the tables place, with its shape (shape symbols)."""
    out = [
        (hf, ("V", "H") if kind == "vocab" else exprs) for hf, _, kind, exprs in (*TOP, *(() if m.tied else (HEAD,)))
    ]
    for i in range(s["L"]):
        for hf, _, kind, exprs in _table(m):
            out.append((hf.format(i=i), (FIRST[kind], *exprs[2:]) if kind in FIRST else exprs[1:]))
        out += moe.names(m.moe, s, i) if m.moe else []
    return out


def _checked(tensors: dict[str, OutputTensor], wanted: list, s: dict[str, int], where: Path | None) -> None:
    """Every wanted tensor there, of its shape and a float dtype, and no other."""
    missing = [n for n, _ in wanted if n not in tensors]
    extra = sorted(set(tensors) - {n for n, _ in wanted})
    if missing or extra:
        what = "; ".join(x for x in (f"missing {', '.join(missing[:4])}" if missing else "",
                                     f"no place for {', '.join(extra[:4])}" if extra else "") if x)  # fmt: skip
        raise PlanError(f"the weights do not match a {s['L']}-layer GPTModel with these tables: {what}", where)
    names = {**hf_export.SYMBOLS, **hf_export.DERIVED, "E": "the expert count", "Im": "the experts' hidden size"}
    for name, exprs in wanted:
        ref = tensors[name].source
        check_shape(name, ref.shape, exprs, s, names, where)
        if ref.dtype not in hf_export.FLOATS:
            raise PlanError(f"{name} is {ref.dtype}; model weights are F32, BF16 or F16", where)


def pieces(tensors: dict[str, OutputTensor], m: Model, padded: int, where: Path | None) -> list[Piece]:
    """Every chunk of the GPTModel, in the Hugging Face tensors' order per layer; a PlanError
    naming a tensor the tables expect and the checkpoint lacks, one they have no place for, or
    one of another shape."""
    s = {**m.sizes, "Vp": padded}
    _checked(tensors, _wanted(m, s), s, where)
    out: list[Piece] = []
    for hf, key, kind, _ in (*TOP, *(() if m.tied else (HEAD,))):
        t = tensors[hf]
        out += _vocab(t, key, padded) if kind == "vocab" else [_whole(t, key, t.shape, None)]
    for i in range(s["L"]):
        for hf, key, kind, _ in _table(m):
            t = tensors[hf.format(i=i)]
            if kind in ("q", "k", "v"):
                out += _grouped(t, key, kind, s, i)
            elif kind in ("gate", "up"):
                out.append(_gate_up(t, key, kind, s, i))
            else:
                out.append(_whole(t, key, (s["L"], *t.shape), i))
                out += [moe.te_norm(out[-1], i)] if m.moe and key == POST_ATTN_NORM else []
        out += moe.layer_pieces(tensors, m.moe, s, i) if m.moe else []
    _one_dtype(out, where)
    return out


def _one_dtype(out: list[Piece], where: Path | None) -> None:
    """Every chunk of a Megatron tensor in the one dtype its ``.metadata`` entry names (a --cast
    that splits a fused tensor's parts, q_proj but not k_proj, has no such dtype)."""
    first: dict[str, Piece] = {}
    for p in out:
        seen = first.setdefault(p.chunk.key, p)
        if p.chunk.dtype != seen.chunk.dtype:
            one, two = (_source(x) for x in (seen, p))
            raise PlanError(f"{p.chunk.key} would hold {one} as {seen.chunk.dtype} and {two} as {p.chunk.dtype}: "
                            "a Megatron tensor has one dtype, so cast its parts alike", where)  # fmt: skip


def _source(p: Piece) -> str:
    """The Hugging Face tensor a chunk is (some of) the rows of: its name without _rows' [first:stop]."""
    assert p.tensor is not None  # a zeros chunk has its tensor's dtype, so it never differs first
    return p.tensor.source.name.partition("[")[0]
