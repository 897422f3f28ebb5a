"""``--quantize SCHEME``: which output tensors llm-compressor's ``model_free_ptq`` quantizes, and
into which tensors (compressed-tensors' names, dtypes and shapes), applied to a compiled plan.

Targets, as ``match_quantizable_tensors`` picks them (compressed-tensors 0.19, utils/match.py):
every ``<module>.weight`` whose module name does not end in ``norm`` and matches no ignore
entry (a plain entry equals the module name; a ``re:`` entry is ``re.match``ed from its start).
The ignore list starts with the defaults (layout.HEAD, the embeddings found by name, layout.ROUTER:
what serves, the Linear weights only), then the user's entries; it is model_free_ptq's ``ignore``
and the config's. Names are the output's (after the rules), as model_free_ptq would see them in
the rewritten checkpoint. A target must be a 2-D float tensor: anything else is refused with the
ignore entry that would leave it out, and so is a source that is already quantized.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace

from streamck.dtypes import CASTABLE
from streamck.errors import PlanError, UsageError, listing
from streamck.plan.compile import OutputTensor, Plan
from streamck.plan.quant.fp4 import fp4_outputs, fp4_unfit
from streamck.plan.quant.layout import (
    EMBEDDINGS,
    HEAD,
    NOT_YET,
    ROUTER,
    SCHEMES,
    output_config,
    quantization_config,
)
from streamck.plan.quant.needs import require_torch
from streamck.transforms.quantize import TILE, Fp8


def check_scheme(scheme: str) -> str:
    """``scheme`` upper-cased if streamck quantizes to it; else a UsageError naming the choices."""
    name = scheme.upper()
    if name in NOT_YET:
        raise UsageError(f"{{quantize}} {scheme}: {NOT_YET[name]}")
    if name not in SCHEMES:
        raise UsageError(f"{{quantize}} {scheme}: unknown scheme; one of {', '.join(SCHEMES)}")
    return name


def is_target(name: str, ignore: list[str]) -> bool:
    """Whether model_free_ptq quantizes the tensor ``name`` (see the module's docstring)."""
    module, _, param = name.rpartition(".")
    if param != "weight" or module.endswith("norm"):
        return False
    return not any(_matches(module, entry) for entry in ignore)


def _matches(module: str, entry: str) -> bool:
    if entry.startswith("re:"):
        return re.match(entry[3:], module) is not None
    return entry == module


def ignore_list(plan: Plan, given: list[str], lm_head: bool = False) -> list[str]:
    """The ignore entries: the defaults (the head unless ``lm_head``, the embeddings present, the
    router pattern), then ``given`` (repeats dropped). A given entry that matches no module of
    the output gets a notice; ``lm_head`` where the head is tied to the embeddings is refused."""
    for entry in given:
        if entry.startswith("re:"):
            try:
                re.compile(entry[3:])
            except re.error as e:
                raise UsageError(f"{{quantize_ignore}} {entry!r}: {e}") from None
    modules = {t.name.rpartition(".")[0] for t in plan.tensors}
    if lm_head:
        _check_head(plan, modules, given)
    embeddings = sorted(m for m in modules if m.rpartition(".")[2] in EMBEDDINGS)
    defaults = [*([] if lm_head else [HEAD]), *embeddings, ROUTER]
    for entry in given:
        if entry not in defaults and not any(_matches(m, entry) for m in modules):
            plan.notices.append(f"--quantize-ignore {entry!r} matches no module of the output; it leaves nothing out")
    return list(dict.fromkeys([*defaults, *given]))


def _check_head(plan: Plan, modules: set[str], given: list[str]) -> None:
    """--quantize-lm-head needs an lm_head of its own: not also ignored, not tied to the embeddings."""
    if HEAD in given:
        raise UsageError("{quantize_lm_head} and {quantize_ignore} lm_head contradict each other")
    config = output_config(plan, beside_source=True) or {}
    if HEAD not in modules or config.get("tie_word_embeddings") is True:
        why = "config.json ties it to the embeddings" if HEAD in modules else "the output has no lm_head.weight"
        raise PlanError(f"{{quantize_lm_head}}: {why}, and the embeddings stay in their dtype; nothing to quantize")


def quantize_plan(plan: Plan, scheme: str, ignore: list[str], lm_head: bool = False, pad_partial: bool = False) -> Plan:
    """``plan`` with every target weight replaced by its quantized tensors and config.json given
    the scheme's ``quantization_config``; ``ignore`` adds to the defaults (ignore_list), ``lm_head``
    quantizes the output head too. FP8_BLOCK leaves a weight with a side no multiple of 128
    unquantized (ignored, with a notice) unless ``pad_partial``, which writes it padded as
    model_free_ptq computes it. Raises UsageError (unknown scheme, bad pattern, no torch) or
    PlanError (an already-quantized source, a target the scheme cannot take)."""
    scheme = check_scheme(scheme)
    require_torch(f"{{quantize}} {scheme}")
    _refuse_quantized(plan)
    ignore = ignore_list(plan, ignore, lm_head)
    strategy = SCHEMES[scheme][0]
    tensors: list[OutputTensor] = []
    targets: list[OutputTensor] = []
    bad: list[str] = []
    for t in plan.tensors:
        if not is_target(t.name, ignore):
            tensors.append(t)
            continue
        if t.transform is not None and t.transform.origin(t.source) is not t.source:
            raise PlanError(f"{{quantize}} {scheme}: {t.name} is a saved copy from the adapter; quantize after merging")
        if len(t.shape) != 2 or t.dtype not in CASTABLE or t.source.dtype not in CASTABLE:
            bad.append(f"{t.name} ({t.dtype}{list(t.shape)})")
            continue
        targets.append(t)
    what, unfit = ("2-D float weights", bad) if bad else fp4_unfit(targets, strategy)
    if unfit:
        first = unfit[0].split(" ")[0].rpartition(".")[0]
        raise PlanError(
            f"{{quantize}} {scheme} takes {what}; these are not: {listing(unfit, 3)}; "
            f"leave them out with {{quantize_ignore}} {first!r} (or a 're:' pattern)"
        )
    if strategy == "block":
        targets, ignore = _partial_tiles(plan, targets, tensors, ignore, pad_partial)
    count = len(targets)
    wide = [t.dtype for t in tensors if t.transform is None and t.dtype in WIDE]
    if strategy in ("tensor_group", "group") and wide:  # see WIDE
        tensors = [replace(t, dtype="BF16") if t.transform is None and t.dtype in WIDE else t for t in tensors]
        plan.notices.append(
            f"--quantize {scheme}: the {len(wide)} other {'/'.join(sorted(set(wide)))} tensors and config.json's "
            "dtype written in bf16, as transformers runs the FP4 weights (decompressed to bf16)"
        )
    if strategy in ("tensor_group", "group"):
        tensors.extend(fp4_outputs(targets, strategy, {t.name for t in plan.tensors}))
    else:
        for t in targets:
            tensors.extend(_quantized(t, strategy))
    if count == 0:
        why = "every weight ignored or none found; FP8_BLOCK also leaves out sides no multiple of 128"
        raise PlanError(f"{{quantize}} {scheme}: no tensor to quantize ({why})")
    tensors.sort(key=lambda t: t.name)
    # A built-in plan (torchtitan, Megatron, …) writes the config it builds among its files.
    files, side = dict(plan.files), dict(plan.side_files)
    summary = [f"quantizing {count} weights to {scheme} as llm-compressor's model_free_ptq (torch, bit for bit)"]
    config = output_config(plan)
    if config is not None:
        config["quantization_config"] = quantization_config(scheme, ignore)
        if wide and strategy in ("tensor_group", "group"):
            config.update(dict.fromkeys([k for k in ("torch_dtype", "dtype") if k in config] or ["dtype"], "bfloat16"))
        body = json.dumps(config, indent=2, sort_keys=True).encode()
        (files if "config.json" in files else side)["config.json"] = body
        summary.append("config.json: quantization_config added (keys sorted, as model_free_ptq writes it)")
    elif not plan.source.path.is_file():
        plan.notices.append("no config.json beside the weights: vLLM needs its quantization_config")
    return replace(plan, tensors=tensors, files=files, side_files=side, summary=[*plan.summary, *summary])


# Float dtypes that FP4's A16 schemes write in bf16 beside the packed weights: compressed-tensors
# decompresses FP4 weights to bf16, and transformers' forward multiplies them with activations of
# the model's dtype (float32 or float16 against bf16 fails).
WIDE = ("F32", "F64", "F16")


def _partial_tiles(
    plan: Plan, targets: list[OutputTensor], kept: list[OutputTensor], ignore: list[str], pad: bool
) -> tuple[list[OutputTensor], list[str]]:
    """FP8_BLOCK targets with a side no multiple of 128: compressed-tensors 0.19 cannot decompress
    their partial tiles, so transformers cannot load the model. By default they stay unquantized,
    their modules added to the ignore list (what an llm-compressor user writes by hand), into
    ``kept``; with ``pad`` they are written padded, as model_free_ptq computes them (for engines
    that read partial tiles). A notice says which. Returns the targets left and the ignore list."""
    partial = [t for t in targets if t.shape[0] % TILE or t.shape[1] % TILE]
    if not partial:
        return targets, ignore
    named = listing([f"{t.name} {list(t.shape)}" for t in partial], 3)
    head = f"--quantize FP8_BLOCK: {len(partial)} weights have a side no multiple of 128 ({named})"
    if pad:
        plan.notices.append(f"{head}: written padded; compressed-tensors 0.19 (transformers) cannot load them")
        return targets, ignore
    plan.notices.append(
        f"{head}: left unquantized and added to the ignore list, since compressed-tensors 0.19 (transformers) "
        "cannot load their partial tiles (FP8_DYNAMIC quantizes every width)"
    )
    kept.extend(partial)
    modules = [t.name.rpartition(".")[0] for t in partial]
    left = {id(t) for t in partial}
    return [t for t in targets if id(t) not in left], list(dict.fromkeys([*ignore, *modules]))


def _quantized(t: OutputTensor, strategy: str) -> list[OutputTensor]:
    """The weight's FP8 values and its scale, both computed from the weight's source (or from
    what its transform computes: a merged LoRA weight, merged once for each)."""
    rows, cols = t.shape
    module = t.name.rpartition(".")[0]
    grid = (rows, 1) if strategy == "channel" else (-(-rows // TILE), -(-cols // TILE))
    inner = t.transform  # a LoRA merge: its output is what is quantized, in the same pass
    return [
        OutputTensor(t.name, t.source, "F8_E4M3", transform=Fp8("weight", strategy, t.dtype, inner=inner)),
        OutputTensor(
            f"{module}.weight_scale",
            t.source,
            t.dtype,
            transform=Fp8("scale", strategy, t.dtype, inner=inner),
            out_shape=grid,
        ),
    ]


QUANT_SUFFIXES = ("weight_scale", "weight_scale_inv", "weight_packed", "weight_global_scale", "weight_zero_point")


def _refuse_quantized(plan: Plan) -> None:
    """An already-quantized source (scales beside its weights, or 8-bit float weights) is refused."""
    names = [t.name for t in plan.tensors if t.name.rpartition(".")[2] in QUANT_SUFFIXES]
    names += [t.name for t in plan.tensors if t.dtype.startswith("F8")]
    if names:
        raise PlanError(
            f"{{quantize}}: the source is already quantized ({listing(sorted(names), 3)}); "
            "dequantize it first with {dtype} bf16"
        )
    config = output_config(plan)
    if config is not None and "quantization_config" in config:
        raise PlanError("{quantize}: the source's config.json has a quantization_config already; dequantize it first")
