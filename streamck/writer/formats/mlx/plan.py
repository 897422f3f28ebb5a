"""The MLX plan pass: a plan of Hugging Face tensors to the tensors ``mlx_lm.convert`` saves for
the same model, without reading a byte.

As ``mlx_lm.utils.load_model`` then ``convert`` decide: the family's ``sanitize`` (tensors
dropped, experts stacked into ``switch_mlp``: a concatenation of the experts' own bytes, read a
band at a time), every float tensor in the dtype MLX holds it in (``--dtype``, else config.json's
``torch_dtype``, else the stored one), and with ``-q`` each quantizable weight (a Linear's, an
Embedding's, a stack's: ``.weight`` of two axes or more, whose last is whole groups) as packed
words, scales and biases (streamck.transforms.mlx_quant). The config is the source's as
``save_config`` writes it. A quantized source (FP8, NVFP4, MXFP4) is first dequantized as
``--dtype`` dequantizes it (dequantized()), each weight computed a band at a time as it is read.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from streamck.dtypes import TORCH_NAMES, castable_dtype
from streamck.errors import PlanError, UsageError
from streamck.plan import OutputTensor, Plan
from streamck.plan.quant.dequant import SCALE_NAMES, dequantize_plan, quantized_kind
from streamck.source import layout
from streamck.source.select import concat
from streamck.transforms.dequantize import Fp4Dequant, Fp8Dequant
from streamck.transforms.mlx_quant import PARTS, MlxQuant, MlxStack, group_shape, packed_shape
from streamck.writer.formats import sidecar
from streamck.writer.formats.mlx import gptoss, table

FLOATS = ("F32", "F16", "BF16")
# What mx.load reads and mlx-lm holds (a quantized source's F8 weights are dequantized first: dequantized()).
MLX_DTYPES = (*FLOATS, "BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64")
DEQUANT = (Fp8Dequant, Fp4Dequant)  # the only transforms read: a quantized source's, band by band


@dataclass
class Prepared:
    """What the layout and the extras need beside the tensors: the folder the config and the
    tokenizer come from, the config as mlx-lm saves it, and the parameter count of its index."""

    model_dir: Path
    config: dict[str, Any]
    parameters: int
    files: dict[str, Path | bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class Choice:
    """What the pass was asked for: the dtype every float tensor is held in (None: config.json's
    ``torch_dtype`` or the stored one) and the quantization (None: none)."""

    dtype: str | None
    scheme: table.Scheme | None


def choice(outtype: str | None, group_size: int | None) -> Choice:
    """``options.outtype`` (``--dtype`` or an MLX ``--quantize`` scheme) and ``--group-size``."""
    kind = (outtype or "auto").lower()
    if kind in table.SCHEMES:
        scheme = table.SCHEMES[kind]
        if group_size is not None:
            if group_size not in table.GROUPS[scheme.mode]:
                sizes = ", ".join(map(str, table.GROUPS[scheme.mode]))
                raise UsageError(f"{{group_size}} {group_size}: MLX's {scheme.mode} mode takes groups of {sizes}")
            scheme = table.Scheme(scheme.mode, group_size, scheme.bits)
        return Choice(None, scheme)
    if group_size is not None:
        schemes = ", ".join(s.upper() for s in table.SCHEMES)
        raise UsageError(f"{{group_size}} applies to an MLX {{quantize}} scheme ({schemes}) only")
    if kind == "auto":
        return Choice(None, None)
    try:
        dtype = castable_dtype(kind)
    except ValueError:
        dtype = None
    if dtype not in FLOATS:
        raise UsageError(f"{{dtype}} {outtype}: MLX output is bf16, f16 or f32 (mlx_lm.convert's dtypes)")
    return Choice(dtype, None)


def model_dir(plan: Plan) -> Path:
    """The folder holding the model's config.json: for a built-in plan's export (a trainer's
    step), the folder of its own config.json and the tokenizer's files
    (streamck.writer.formats.sidecar); else where the plan's side files come from, else the source's."""
    if sidecar.exported_config(plan) is not None:
        return sidecar.model_folder(plan, "MLX")
    config = plan.side_files.get("config.json")
    where = config.parent if isinstance(config, Path) else None
    if where is None and plan.source is not None:
        where = plan.source.side_root or plan.source.root
    if where is None or not (where / "config.json").is_file():
        raise PlanError(f"MLX output needs the model's config.json beside the weights, and {where} has none")
    return where


def load_config(where: Path) -> dict[str, Any]:
    """``mlx_lm.utils.load_config``: config.json, with generation_config.json's ``eos_token_id``."""
    config = json.loads((where / "config.json").read_bytes())
    gen = where / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_bytes()).get("eos_token_id", False)
        except ValueError:
            eos = False
        if eos:
            config["eos_token_id"] = eos
    return config


def family_of(config: dict[str, Any]) -> table.Family:
    """The family of config.json's ``model_type``; a PlanError naming it where there is none."""
    kind = config.get("model_type")
    if kind not in table.FAMILIES:
        raise PlanError(f"model_type {kind}: MLX output does not convert it (it converts {', '.join(table.FAMILIES)})")
    return table.FAMILIES[kind]


def held_dtype(config: dict[str, Any]) -> str | None:
    """``convert``'s default dtype: config.json's ``torch_dtype``, else ``text_config.dtype``,
    where it is one of its three; None (the stored dtypes) otherwise."""
    dtype = config.get("torch_dtype")
    if dtype is None and (text := config.get("text_config")):
        dtype = text.get("dtype")
    return table.DTYPES.get(dtype) if isinstance(dtype, str) else None


def sanitized(plan: Plan, fam: table.Family, config: dict[str, Any]) -> list[OutputTensor]:
    """The plan's tensors as ``sanitize`` leaves them: dropped ones gone, experts stacked."""
    tied = config.get("tie_word_embeddings", fam is table.FAMILIES["llama"])
    out = []
    for t in plan.tensors:
        if t.transform is not None and not isinstance(t.transform, DEQUANT):
            raise PlanError(f"{t.name} is computed ({t.transform.label}): MLX output reads stored tensors only, yet")
        if t.dtype not in MLX_DTYPES:
            raise PlanError(f"{t.name} is {t.dtype}: MLX output reads unquantized models only, yet")
        if any(d in t.name for d in fam.dropped) or (tied and t.name == "lm_head.weight"):
            continue
        out.append(t)
    if fam.fused:  # gpt-oss: its fused experts split as its own sanitize splits them
        return gptoss.sanitized(out, config)
    return stack_experts(out, fam, config) if fam.block else out


def stack_experts(tensors: list[OutputTensor], fam: table.Family, config: dict[str, Any]) -> list[OutputTensor]:
    """Each MoE block's ``experts.<e>.<disk>.weight`` as one ``switch_mlp.<name>.weight`` [E, …]."""
    count = config.get("num_experts") or config.get("num_local_experts")
    pattern = re.compile(rf"^(.*\.{re.escape(fam.block)})\.experts\.(\d+)\.(\w+)\.weight$")
    groups: dict[tuple[str, str], dict[int, OutputTensor]] = {}
    rest = []
    for t in tensors:
        m = pattern.match(t.name)
        if m is None:
            rest.append(t)
        else:
            groups.setdefault((m[1], m[3]), {})[int(m[2])] = t
    names = dict(fam.stacks)
    for (block, disk), experts in groups.items():
        if disk not in names:
            raise PlanError(f"MoE block {block}: expert tensor {disk} is not one mlx-lm stacks ({', '.join(names)})")
        if sorted(experts) != list(range(count or 0)):
            raise PlanError(f"MoE block {block}: experts {sorted(experts)} of {disk}, but config.json says {count}")
        rest.append(_stack(f"{block}.switch_mlp.{names[disk]}.weight", [experts[e] for e in range(count)]))
    return rest


def _stack(name: str, experts: list[OutputTensor]) -> OutputTensor:
    first = experts[0]
    if any(t.dtype != first.dtype or t.shape != first.shape for t in experts):
        raise PlanError(f"{name}: the experts' {first.name.rsplit('.', 2)[-2]} differ in dtype or shape")
    computed = [t for t in experts if t.transform is not None]  # a quantized source's, dequantized
    if computed and len(computed) < len(experts):
        raise PlanError(f"{name}: some of its experts are quantized ({computed[0].name}) and some not")
    if computed:  # dequantized expert by expert, never a whole stack
        stack = MlxStack(tuple((t.source, t.transform) for t in experts), first.dtype)  # type: ignore[misc]
        return OutputTensor(name, first.source, first.dtype, stack, (len(experts), *first.shape))
    try:
        ref = concat(name, [t.source for t in experts])
    except ValueError as e:
        raise PlanError(str(e)) from None
    return OutputTensor(name, ref._replace(shape=(len(experts), *first.shape)), first.dtype)


def quantization(name: str, shape: tuple[int, ...], fam: table.Family, scheme: table.Scheme) -> dict | None:
    """How ``quantize_model`` quantizes the weight ``name`` of ``shape``: None (left as it is),
    or its ``group_size`` and ``bits`` (with ``override``: the family's predicate's, which the
    config records per module)."""
    if not name.endswith(".weight") or len(shape) < 2 or shape[-1] % scheme.group:
        return None
    module = name[: -len(".weight")]
    own = next((dict(p) for end, p in fam.predicate if module.endswith(end)), None)
    if own is not None:
        if shape[-1] % own["group_size"]:
            raise PlanError(f"{name}: its width {shape[-1]} is no multiple of {own['group_size']}, as mlx-lm needs")
        return {**own, "override": True}
    return {"group_size": scheme.group, "bits": scheme.bits, "mode": scheme.mode}


def quantized(t: OutputTensor, dtype: str, q: dict) -> list[OutputTensor]:
    """The weight ``t`` as MLX's tensors: packed words (U32), and scales and biases in ``dtype``
    (``affine``) or scale bytes (E8M0 for ``mxfp4`` and ``mxfp8``, E4M3 for ``nvfp4``)."""
    read = t.source.dtype if t.transform is None else t.dtype  # a dequantized weight: its output's dtype
    if read not in FLOATS:
        raise PlanError(f"{t.name} is {read}: MLX output quantizes F32, F16 or BF16 weights only")
    group, bits, mode = q["group_size"], q["bits"], q.get("mode", "affine")
    module = t.name[: -len(".weight")]
    out = []
    for part in PARTS[mode]:
        shape = packed_shape(t.shape, bits) if part == "weight" else group_shape(t.shape, group)
        kind = "U32" if part == "weight" else dtype if mode == "affine" else "U8"
        transform = MlxQuant(part, t.shape, dtype, group, bits, mode, inner=t.transform, computes=read)
        out.append(OutputTensor(f"{module}.{part}", t.source, kind, transform, shape))
    return out


def prepare(plan: Plan, outtype: str | None, group_size: int | None) -> tuple[Plan, Prepared]:
    """``plan``'s tensors as ``mlx_lm.convert``'s, in its parameter order, and the config and
    files that go beside them."""
    ask = choice(outtype, group_size)
    where = model_dir(plan)
    config = load_config(where)
    fam = family_of(config)
    default = held_dtype(config)
    native = gptoss.native_quantization(plan, config) if fam.fused else None  # gpt-oss's MXFP4 stays packed
    if native is None:
        plan, ask = dequantized(plan, ask, default, config)
    scheme = ask.scheme
    quant = None if scheme is None else {"group_size": scheme.group, "bits": scheme.bits, "mode": scheme.mode}
    quant = native or quant
    out, parameters = [], 0
    for t in sanitized(plan, fam, config):
        dtype = _held(t, ask.dtype or (None if t.is_cast else default))
        parameters += gptoss.parameters(t) if fam.fused else math.prod(t.shape)
        q = None if ask.scheme is None or dtype not in FLOATS else quantization(t.name, t.shape, fam, ask.scheme)
        if q is None:
            out.append(t if dtype == t.dtype else OutputTensor(t.name, t.source, dtype, t.transform, t.out_shape))
            continue
        if q.pop("override", False) or native:  # a quantized source's config names each module quantized
            quant[t.name[: -len(".weight")]] = dict(q)
        out += quantized(t, dtype, q)
    if ask.scheme is not None and not any(isinstance(t.transform, MlxQuant) for t in out):
        g = ask.scheme.group
        raise PlanError(f"groups of {g} divide no weight's width: nothing would be quantized (try {{group_size}} 32)")
    out.sort(key=lambda t: order_key(t.name, fam))
    prepared = Prepared(where, saved_config(config, quant), parameters, side_files(where))
    what = f"quantized {ask.scheme.mode} {ask.scheme.bits}-bit, groups of {ask.scheme.group}" if ask.scheme else ""
    head = f"MLX {config['model_type']}{', ' + what if what else ''}"
    summary = [*plan.summary, f"{head}, config from {sidecar.describe(where)}"]
    return Plan(out, {"format": "mlx"}, source=plan.source, summary=summary, notices=plan.notices), prepared


def dequantized(plan: Plan, ask: Choice, default: str | None, config: dict[str, Any]) -> tuple[Plan, Choice]:
    """A quantized source (FP8, NVFP4, MXFP4: streamck.plan.quant.dequant) as ``--dtype D``
    dequantizes it, D the dtype MLX is to hold it in (``--dtype``, else config.json's, else
    bf16), every float then held in D: what ``mlx_lm.convert`` makes of streamck's ``--dtype D``
    output. Its ``quantization_config`` leaves ``config``, whose ``torch_dtype`` (``dtype``) says
    D, as that output's does. A plan the passes have dequantized
    already (a ``--dtype`` cast beside an MLX scheme) is left as it is; an unquantized one too."""
    if plan.source is None or quantized_kind(plan) is None:
        return plan, ask
    config.pop("quantization_config", None)
    if any(_still_quantized(t) for t in plan.tensors):
        dtype = ask.dtype or default or "BF16"
        plan, ask = dequantize_plan(plan, dtype), Choice(dtype, ask.scheme)
    else:  # the passes' own dequantization, to the --dtype beside the scheme
        dtype = next((t.dtype for t in plan.tensors if isinstance(t.transform, DEQUANT)), None)
    for key in ("torch_dtype", "dtype"):  # as --dtype's cast labels its config (streamck.plan.compile)
        if dtype is not None and isinstance(config.get(key), str):
            config[key] = TORCH_NAMES[dtype]
    return plan, ask


def _still_quantized(t: OutputTensor) -> bool:
    """Whether ``t`` is a quantized source's weight or scale, as stored (not yet dequantized)."""
    param = t.name.rpartition(".")[2]
    return t.transform is None and (t.source.dtype.startswith("F8") or param in SCALE_NAMES or param == "weight_packed")


def _held(t: OutputTensor, dtype: str | None) -> str:
    """The dtype MLX holds ``t`` in: ``dtype`` for a float tensor where one is chosen, else its own."""
    return dtype if dtype is not None and t.dtype in FLOATS else t.dtype


_SECTIONS = (("model.embed_tokens.", 0), ("model.layers.", 1), ("model.norm.", 2), ("lm_head.", 3))
_NORM_FIRST = (("model.embed_tokens.", 0), ("model.norm.", 0.5), ("model.layers.", 1), ("lm_head.", 3))
_LEAVES = {"weight": 0, "scales": 1, "biases": 2, "bias": 3}


def order_key(name: str, fam: table.Family) -> tuple:
    """Where ``name`` comes in ``tree_flatten(model.parameters())``: embeddings, the layers in
    order (each module in the family's order; weight, scales, biases, bias), the norm, lm_head;
    a name the table does not place comes after, in name order."""
    module, _, leaf = name.rpartition(".")
    sections = _NORM_FIRST if fam.norm_first else _SECTIONS
    section = next((rank for prefix, rank in sections if name.startswith(prefix)), None)
    if section is None:
        return (9, 0, 0, name)
    if section != 1:
        return (section, 0, _LEAVES.get(leaf, 9), name)
    layer, _, inner = module[len("model.layers.") :].partition(".")
    place = fam.layer.index(inner) if inner in fam.layer else len(fam.layer)
    return (1, int(layer) if layer.isdigit() else 0, place * 10 + _LEAVES.get(leaf, 9), name)


def saved_config(config: dict[str, Any], quant: dict | None) -> dict[str, Any]:
    """``save_config``'s config: ``_name_or_path`` and ``vision_config`` dropped, the quantization
    as ``quantization`` and ``quantization_config`` alike, keys sorted."""
    config = {k: v for k, v in config.items() if k not in ("_name_or_path", "vision_config")}
    if quant is not None:
        config["quantization"] = quant
        config["quantization_config"] = quant
    return dict(sorted(config.items()))


def side_files(where: Path) -> dict[str, Path | bytes]:
    """What ``save`` writes beside the weights and the config: the tokenizer's files, the
    model's ``*.py`` and generation_config.json, and its model card; not a file that links out
    of the folder (streamck.source.layout.escapes: the plan's note names it)."""
    files: dict[str, Path | bytes] = {}
    for p in sorted(where.iterdir()):
        if p.is_file() and (p.name in table.TOKENIZER_FILES or p.suffix == ".py") and not layout.escapes(p, where):
            files[p.name] = p
    files["README.md"] = table.README
    return files
