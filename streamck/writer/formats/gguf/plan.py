"""The GGUF plan pass: a plan of Hugging Face tensors to the tensors of the GGUF file that
``convert_hf_to_gguf.py`` writes for the same model, without reading a byte.

Per tensor, as the reference's ``ModelBase.prepare_tensors`` decides: its GGUF name (gguf-py's
``TensorNameMap``), its rows reordered where the family's RoPE layout differs (Llama's q_proj and
k_proj, ``LlamaModel.permute``: a row selection over the source's own bytes,
streamck.source.select), and its type: F32 for 1-D tensors, norms and biases, else the file's
type (``--outtype``), Q8_0 through streamck.transforms.q8_0 (F16 where a row is not whole blocks).
Tensors the reference computes from the config (Llama 3's ``rope_freqs``) come first, as it writes them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf

from streamck.errors import PlanError
from streamck.plan import OutputTensor, Plan
from streamck.source.layout import escapes
from streamck.source.select import Rows, select
from streamck.transforms.q8_0 import BLOCK, Q8_0, q8_0_shape
from streamck.writer.formats import sidecar
from streamck.writer.formats.gguf import compat, computed, gptoss, meta, mla, rope, table
from streamck.writer.formats.gguf.experts import Stacker

FLOATS = ("F64", "F32", "F16", "BF16")


@dataclass
class Prepared:
    """What the layout needs beside the tensors: the family, the config, the folder the
    metadata and vocabulary are read from, and the file type (``gguf.LlamaFileType``)."""

    family: table.Family
    hparams: dict[str, Any]
    model_dir: Path
    ftype: gguf.LlamaFileType


def model_dir(plan: Plan) -> Path:
    """The folder holding the model's config.json and tokenizer: for a built-in plan's export
    (a trainer's step), the folder of its own config.json and the tokenizer's files
    (streamck.writer.formats.sidecar); else where the plan's side files come from, else the
    source's. A PlanError where it has no config.json or no tokenizer."""
    if sidecar.exported_config(plan) is not None:
        return sidecar.model_folder(plan, "GGUF")
    where = next(
        (p.parent for n in ("config.json", "tokenizer.json") if isinstance(p := plan.side_files.get(n), Path)), None
    )
    if where is None and plan.source is not None:
        where = plan.source.side_root or plan.source.root
    if where is None or not (where / "config.json").is_file():
        needs = "GGUF output needs the model's config.json and tokenizer beside the weights"
        raise PlanError(f"{needs}, and {where} has no config.json")
    return where


# The files the header is made of (the config, the vocabulary, gguf-py's SpecialVocab's).
READ = ("config.json", "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "generation_config.json",
        "special_tokens_map.json", "added_tokens.json")  # fmt: skip


def check_side_files(where: Path) -> None:
    """A PlanError naming the first of READ in ``where`` that links out of it (it is not read into
    the file, as ``-o DIR`` does not copy it) or, a JSON one, is no JSON, before the readers meet it."""
    for name in READ:
        path = where / name
        if not path.exists() and not path.is_symlink():
            continue
        if escapes(path, where):
            raise PlanError("links out of the model's folder: not read (copy the file in)", path)
        try:
            if name == "tokenizer.json":
                compat.tokenizer_json(path)  # kept for the header
            elif name.endswith(".json"):
                json.loads(path.read_bytes())
        except ValueError as e:
            raise PlanError(f"not valid JSON ({e})", path) from None


def family_of(hparams: dict[str, Any]) -> table.Family:
    """The table's row for the config's architecture; a PlanError naming it where there is none."""
    arch = (hparams.get("architectures") or [None])[0]
    if arch not in table.FAMILIES:
        known = ", ".join(table.FAMILIES)
        raise PlanError(f"architecture {arch}: GGUF output does not convert it (it converts {known})")
    return table.FAMILIES[arch]


def file_type(outtype: str, tensors: list[OutputTensor]) -> gguf.LlamaFileType:
    """``--outtype`` as ``gguf.LlamaFileType``; ``auto`` is the planned dtype of the first 2-D
    tensor (BF16, F16, or F32: so ``--dtype`` chooses), F16 where there is none."""
    if outtype == "auto":
        first = next((t.dtype for t in tensors if len(t.shape) >= 2 and t.dtype in FLOATS), "F16")
        outtype = {"BF16": "bf16", "F32": "f32"}.get(first, "f16")
    if outtype not in table.FILE_TYPES:
        raise PlanError(f"GGUF type {outtype!r}: one of {', '.join(table.FILE_TYPES)}")
    return gguf.LlamaFileType[table.FILE_TYPES[outtype]]


def prepare(plan: Plan, outtype: str = "auto") -> tuple[Plan, Prepared]:
    """``plan``'s tensors as the GGUF file's, in the reference's order, and what its keys need."""
    where = model_dir(plan)
    check_side_files(where)
    hparams = json.loads((where / "config.json").read_bytes())
    family = family_of(hparams)
    meta.check_parameters(family, hparams)
    meta.check_tokenizer(where, family)
    ftype = file_type(outtype, plan.tensors)
    plan = computed.dequantized(plan)  # an FP8 source's weights, as the reference's dequant_model
    arch = gguf.MODEL_ARCH[family.arch]
    names = gguf.get_tensor_name_map(arch, hparams["num_hidden_layers"])
    stacker = _stacker(family, hparams)
    rewriter = gptoss.Rewriter(names, lambda n, shape: _qtype(n, shape, ftype)) if family.gptoss else None
    out = []
    for t in _rewritten(family, hparams, sorted(plan.tensors, key=lambda t: (t.source.path.name, t.name))):
        if t.name.endswith(table.SKIPPED_SUFFIXES):
            continue
        if rewriter is not None and (done := rewriter.take(t)) is not None:
            out += done  # gpt-oss's experts, sinks and expert biases (streamck.writer.formats.gguf.gptoss)
            continue
        stacked = stacker.take(t) if stacker else None
        for s in [t] if stacked is None else stacked:
            name = names.get_name(key=s.name, try_suffixes=(".weight", ".bias"))
            if name is None:
                raise PlanError(f"tensor {s.name} has no GGUF name for {gguf.MODEL_ARCH_NAMES[arch]}")
            out.append(_output(s, name, _rows(s, family, hparams), ftype))
    if stacker:
        stacker.finish()
    extra = [*_generated(family, hparams, where), *(rewriter.finish() if rewriter else [])]
    out = [*extra, *out]  # generate_extra_tensors's come first
    summary = [*plan.summary, f"GGUF {gguf.MODEL_ARCH_NAMES[arch]}, {ftype.name}, keys from {sidecar.describe(where)}"]
    gguf_plan = Plan(out, {}, source=plan.source, summary=summary, notices=plan.notices)
    return gguf_plan, Prepared(family, hparams, where, gptoss.file_type_key(ftype, hparams))


def _generated(family: table.Family, hparams: dict[str, Any], where: Path) -> list[OutputTensor]:
    """The tensors the reference computes from the config (``generate_extra_tensors``): Llama 3's
    ``rope_freqs.weight`` where its RoPE type is ``llama3``, else none."""
    params = meta.rope_parameters(hparams)
    params = params.get("full_attention", params)
    if family.rope_freqs and rope.is_llama3(params):
        return [rope.tensor(params, hparams, where / "config.json")]
    return []


def _rewritten(family: table.Family, hparams: dict[str, Any], tensors: list[OutputTensor]) -> Iterator[OutputTensor]:
    """``tensors`` (by file, then name) as the family's ``modify_tensors`` hands them on: DeepSeek's
    kv_b_proj split and renames (streamck.writer.formats.gguf.mla), else each as it is."""
    for t in tensors:
        yield from mla.rewrite(t, hparams) if family.mla else (t,)


def _stacker(family: table.Family, hparams: dict[str, Any]) -> Stacker | None:
    """The family's expert stacker (None for a dense family); PlanError where config.json
    states no expert count."""
    if family.experts is None:
        return None
    count = meta.find(hparams, table.EXPERT_COUNT)
    if not isinstance(count, int) or count < 1:
        raise PlanError(f"config.json states no expert count ({' or '.join(table.EXPERT_COUNT)})")
    return computed.DequantStacker(family.experts, count)


def _rows(t: OutputTensor, family: table.Family, hparams: dict[str, Any]) -> Rows | None:
    """The row order ``LlamaModel.permute`` gives q_proj / k_proj: per head, output row
    ``2*j + a`` is source row ``a*hd/2 + j`` (rotate-half pairs interleaved); None for the rest."""
    if not family.permute_qk or not t.name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
        return None
    heads = hparams["num_attention_heads"]
    if t.name.endswith(("k_proj.weight", "k_proj.bias")) and hparams.get("num_key_value_heads", heads) != heads:
        heads = hparams["num_key_value_heads"]
    hd = t.shape[0] // heads
    return Rows(0, (heads, hd // 2, 2), (hd, 1, hd // 2))


def _output(t: OutputTensor, name: str, rows: Rows | None, ftype: gguf.LlamaFileType) -> OutputTensor:
    """The GGUF tensor ``name`` made of ``t``'s source (its ``rows`` where given), in the type
    the reference gives it."""
    if t.transform is not None:  # a dequantized weight (streamck.writer.formats.gguf.computed), else refused
        return computed.output(t, name, _qtype(name, t.shape, ftype), rows is not None)
    if t.source.dtype not in FLOATS:
        raise PlanError(f"{t.name} is {t.source.dtype}: GGUF output converts float tensors only")
    try:
        source = t.source if rows is None else select(t.source, rows)
    except ValueError as e:  # rows a plan gathered that the reference's order cannot be read from
        raise PlanError(str(e)) from None
    qtype = _qtype(name, t.shape, ftype)
    if qtype == "Q8_0":
        return OutputTensor(name, source, "U8", Q8_0(t.shape), q8_0_shape(t.shape))
    return OutputTensor(name, source, qtype)


def _qtype(name: str, shape: tuple[int, ...], ftype: gguf.LlamaFileType) -> str:
    """``prepare_tensors``'s choice: F32 for 1-D tensors, norms, routers (table.F32_TENSORS) and
    anything not a ``.weight``; else the file type's, Q8_0 falling back to F16 where the last
    axis is not whole blocks."""
    if len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight") or _kept_f32(name):
        return "F32"
    kind = {"ALL_F32": "F32", "MOSTLY_F16": "F16", "MOSTLY_BF16": "BF16", "MOSTLY_Q8_0": "Q8_0"}[ftype.name]
    if kind == "Q8_0" and shape[-1] % BLOCK:
        return "F16"
    return kind


def _kept_f32(name: str) -> bool:
    """Whether ``name`` (``blk.N.kind.weight``) is one of the tensors the reference keeps in F32
    in every file type (``match_model_tensor_name`` against table.F32_TENSORS)."""
    parts = name.split(".")
    if len(parts) != 4 or not parts[1].isdecimal():
        return False
    kinds = (gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[k]] for k in table.F32_TENSORS)
    return any(k.format(bid=parts[1]) + ".weight" == name for k in kinds)
