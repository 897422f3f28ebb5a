"""``--quantize SCHEME``: which output tensors llm-compressor's ``model_free_ptq`` quantizes, and
into which tensors (compressed-tensors' names, dtypes and shapes), applied to a compiled plan.

Targets, as ``match_quantizable_tensors`` picks them (compressed-tensors 0.19, utils/match.py):
every ``<module>.weight`` whose module name does not end in ``norm`` and matches no ignore
entry (a plain entry equals the module name; a ``re:`` entry is ``re.match``ed from its start).
Names are the output's (after the rules), as model_free_ptq would see them in the rewritten
checkpoint. A target must be a 2-D float tensor: anything else is refused with the ignore entry
that would leave it out, and so is a source that is already quantized.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace

from streamck.dtypes import CASTABLE
from streamck.errors import PlanError, UsageError, listing
from streamck.plan.compile import OutputTensor, Plan
from streamck.plan.quant.fp4 import fp4_outputs, fp4_unfit
from streamck.plan.quant.layout import NOT_YET, SCHEMES, USUAL_IGNORE, output_config, quantization_config
from streamck.transforms.quantize import TILE, Fp8


def check_scheme(scheme: str) -> str:
    """``scheme`` upper-cased if streamck quantizes to it; else a UsageError naming the choices."""
    name = scheme.upper()
    if name in NOT_YET:
        raise UsageError(f"--quantize {scheme}: {NOT_YET[name]}")
    if name not in SCHEMES:
        raise UsageError(f"--quantize {scheme}: unknown scheme; one of {', '.join(SCHEMES)}")
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


def quantize_plan(plan: Plan, scheme: str, ignore: list[str]) -> Plan:
    """``plan`` with every target weight replaced by its quantized tensors and config.json given
    the scheme's ``quantization_config``. Raises UsageError (unknown scheme, bad pattern) or
    PlanError (an already-quantized source, a target the scheme cannot take)."""
    scheme = check_scheme(scheme)
    for entry in ignore:
        if entry.startswith("re:"):
            try:
                re.compile(entry[3:])
            except re.error as e:
                raise UsageError(f"--quantize-ignore {entry!r}: {e}") from None
    _refuse_quantized(plan)
    strategy = SCHEMES[scheme][0]
    tensors: list[OutputTensor] = []
    targets: list[OutputTensor] = []
    bad: list[str] = []
    for t in plan.tensors:
        if not is_target(t.name, ignore):
            tensors.append(t)
            continue
        if t.transform is not None and t.transform.origin(t.source) is not t.source:
            raise PlanError(f"--quantize {scheme}: {t.name} is a saved copy from the adapter; quantize after merging")
        if len(t.shape) != 2 or t.dtype not in CASTABLE or t.source.dtype not in CASTABLE:
            bad.append(f"{t.name} ({t.dtype}{list(t.shape)})")
            continue
        targets.append(t)
    what, unfit = ("2-D float weights", bad) if bad else fp4_unfit(targets, strategy)
    if unfit:
        first = unfit[0].split(" ")[0].rpartition(".")[0]
        raise PlanError(
            f"--quantize {scheme} takes {what}; these are not: {listing(unfit, 3)}; "
            f"leave them out with --quantize-ignore {first!r} (or a 're:' pattern)"
        )
    count = len(targets)
    if strategy in ("tensor_group", "group"):
        tensors.extend(fp4_outputs(targets, strategy, {t.name for t in plan.tensors}))
    else:
        for t in targets:
            tensors.extend(_quantized(t, strategy))
    if count == 0:
        raise PlanError(f"--quantize {scheme}: no tensor to quantize (every weight ignored or none found)")
    tensors.sort(key=lambda t: t.name)
    # A built-in plan (torchtitan, Megatron, …) writes the config it builds among its files.
    files, side = dict(plan.files), dict(plan.side_files)
    summary = [f"quantizing {count} weights to {scheme} as llm-compressor's model_free_ptq (torch, bit for bit)"]
    config = output_config(plan)
    if config is not None:
        config["quantization_config"] = quantization_config(scheme, ignore)
        body = json.dumps(config, indent=2, sort_keys=True).encode()
        (files if "config.json" in files else side)["config.json"] = body
        summary.append("config.json: quantization_config added (keys sorted, as model_free_ptq writes it)")
    elif not plan.source.path.is_file():
        plan.notices.append("no config.json beside the weights: vLLM needs its quantization_config")
    if not any(_matches(m, e) for e in ignore for m in ("lm_head",)):
        plan.notices.append(f"lm_head is quantized too; users normally pass --quantize-ignore for {USUAL_IGNORE}")
    return replace(plan, tensors=tensors, files=files, side_files=side, summary=[*plan.summary, *summary])


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
            f"--quantize: the source is already quantized ({listing(sorted(names), 3)}); "
            "dequantize it first with --dtype bf16"
        )
    config = output_config(plan)
    if config is not None and "quantization_config" in config:
        raise PlanError("--quantize: the source's config.json has a quantization_config already; dequantize it first")
