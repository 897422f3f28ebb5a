"""``--dtype`` on a quantized source: its weights dequantized as transformers 5.19 and
compressed-tensors 0.19 load them (streamck.transforms.dequantize), their scales dropped,
``quantization_config`` removed.

Three layouts are read: DeepSeek-V3's (``quant_method: fp8``: ``<m>.weight`` E4M3 beside
``<m>.weight_scale_inv``, one float32 scale per ``weight_block_size`` block, 128×128),
compressed-tensors' FP8 (``<m>.weight`` E4M3 beside ``<m>.weight_scale``: per row, per tensor or
per block) and compressed-tensors' packed FP4 (``<m>.weight_packed`` U8 beside ``<m>.weight_scale``:
E4M3 per 16 values with ``<m>.weight_global_scale`` F32 [1] for NVFP4, U8 E8M0 per 32 values for
MXFP4). Anything else quantized (integer packing, zero points, other methods) is refused by name.
"""

from __future__ import annotations

import json
from dataclasses import replace

from streamck.errors import PlanError, listing
from streamck.plan.compile import OutputTensor, Plan
from streamck.plan.quant.layout import output_config
from streamck.transforms.dequantize import Fp4Dequant, Fp8Dequant
from streamck.transforms.fp4 import GROUP

# scale suffix -> the layout it marks
SCALES = {"weight_scale_inv": "fp8", "weight_scale": "compressed-tensors"}
PACKED = ("weight_packed", "weight_global_scale", "weight_zero_point")
# Activation scales of a static scheme: meaningless once the weights are floats (transformers drops them too).
ACTIVATION = ("input_scale", "activation_scale", "output_scale", "input_global_scale")
# compressed-tensors formats --dtype dequantizes (config_groups' "format")
FORMATS = ("float-quantized", "naive-quantized", "nvfp4-pack-quantized", "mxfp4-pack-quantized")
# packed FP4 by its scale's dtype: (kind, values a scale, whether a global scale goes with it)
FP4_SCALES = {"F8_E4M3": ("nv", GROUP["nv"], True), "U8": ("mx", GROUP["mx"], False)}
SCALE_NAMES = (*SCALES, *PACKED, *ACTIVATION)


def _config(plan: Plan) -> dict:
    return output_config(plan, beside_source=True) or {}


def quantized_kind(plan: Plan) -> str | None:
    """ "fp8" (DeepSeek-V3 layout), "compressed-tensors", or None for a source that is not quantized."""
    qc = _config(plan).get("quantization_config")
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    names = {ref.name.rpartition(".")[2] for ref in plan.source.tensors.values()}
    if method == "fp8" or "weight_scale_inv" in names:
        return "fp8"
    if method is not None or names & {"weight_scale", *PACKED}:
        return str(method or "compressed-tensors")
    return None


def _block(plan: Plan, kind: str) -> tuple[int, int] | None:
    """The scale block of a grid-scaled layout (DeepSeek's weight_block_size; compressed-tensors'
    block_structure), or None where the scales are per row or per tensor."""
    qc = _config(plan).get("quantization_config") or {}
    if kind == "fp8":
        size = qc.get("weight_block_size") or [128, 128]
        return (int(size[0]), int(size[1]))
    formats = {g.get("format", qc.get("format")) for g in (qc.get("config_groups") or {}).values()} | {qc.get("format")}
    formats.discard(None)
    unknown = formats - set(FORMATS)
    if unknown:
        raise PlanError(
            f"dequantizing {', '.join(sorted(unknown))} is not supported (only {', '.join(FORMATS)}); "
            "drop --dtype to copy it as is"
        )
    blocks = {
        tuple(g["weights"]["block_structure"])
        for g in qc.get("config_groups", {}).values()
        if (g.get("weights") or {}).get("block_structure")
    }
    if len(blocks) > 1:
        raise PlanError(f"several block sizes in quantization_config ({sorted(blocks)}); not supported")
    return blocks.pop() if blocks else None


def dequantize_plan(plan: Plan, dtype: str) -> Plan:
    """``plan`` (compiled with ``--dtype dtype``) with every FP8 and packed FP4 weight dequantized
    into ``dtype``, its scales and activation scales dropped, and ``quantization_config`` out of
    config.json. Raises PlanError for a layout it cannot dequantize (nothing is approximated)."""
    kind = quantized_kind(plan)
    if kind not in ("fp8", "compressed-tensors"):
        raise PlanError(
            f"the source is {kind}-quantized; dequantizing it is not supported (DeepSeek FP8 and "
            "compressed-tensors FP8, NVFP4 and MXFP4 only)"
        )
    block = _block(plan, kind)
    by_name = {t.name: t for t in plan.tensors}
    zero = [n for n in by_name if n.endswith(".weight_zero_point")]
    if zero:
        raise PlanError(f"asymmetric weights ({listing(zero, 3)}): dequantizing zero points is not supported")
    out_dtype = plan_dtype(plan, dtype)
    tensors, used, fp4 = [], set(), 0
    for t in plan.tensors:
        module, _, param = t.name.rpartition(".")
        if param in ACTIVATION or param in SCALES or param == "weight_global_scale":
            continue
        if param == "weight_packed":
            tensors.append(_fp4(t, by_name, out_dtype, used))
            fp4 += 1
            continue
        if t.source.dtype != "F8_E4M3":
            tensors.append(t)
            continue
        suffix = "weight_scale_inv" if kind == "fp8" else "weight_scale"
        scale = by_name.get(f"{module}.{suffix}")
        if param != "weight" or scale is None or len(t.shape) != 2:
            raise PlanError(
                f"{t.name} is {t.source.dtype}{list(t.shape)} without a {suffix} beside it; cannot dequantize"
            )
        used.add(scale.name)
        grid = block if (len(scale.shape) == 2 and scale.shape[1] > 1) or kind == "fp8" else None
        _check_grid(t, scale, grid)
        tensors.append(
            OutputTensor(t.name, t.source, out_dtype, transform=Fp8Dequant(scale.source, kind, grid or (1, 1)))
        )
    stray = [n for n in by_name if n.rpartition(".")[2] in (*SCALES, "weight_global_scale") and n not in used]
    if stray:
        raise PlanError(f"scales without a quantized weight beside them: {listing(stray, 3)}")
    side = dict(plan.side_files)
    config = _config(plan)
    fp8 = len([n for n in used if n.rpartition(".")[2] in SCALES]) - fp4
    summary = [f"dequantizing {fp8} FP8 weights ({kind}) to {out_dtype}, as transformers loads them"] if fp8 else []
    if fp4:
        summary.append(
            f"dequantizing {fp4} packed FP4 weights to {out_dtype}, as compressed-tensors' decompressor does "
            "(to bf16, then cast)"
        )
    if "config.json" in side and "quantization_config" in config:
        del config["quantization_config"]
        side["config.json"] = (json.dumps(config, indent=2) + "\n").encode()
        summary.append("config.json: quantization_config removed")
    return replace(plan, tensors=tensors, side_files=side, summary=[*plan.summary, *summary])


def plan_dtype(plan: Plan, dtype: str) -> str:
    """The dtype the rules cast floats to (``--dtype``), as the plan spells it."""
    from streamck.plan.rules import Rules

    return Rules((), dtype).dtype or dtype


def _check_grid(t: OutputTensor, scale: OutputTensor, grid: tuple[int, int] | None) -> None:
    rows, cols = t.shape
    if grid is None:
        want = [(rows, 1), (1,), (1, 1)]
    else:
        want = [(-(-rows // grid[0]), -(-cols // grid[1]))]
    if tuple(scale.source.shape) not in want:
        raise PlanError(
            f"{scale.name} is {list(scale.source.shape)}; for {t.name} {list(t.shape)} expected {list(want[0])}"
        )


def _fp4(t: OutputTensor, by_name: dict[str, OutputTensor], out_dtype: str, used: set[str]) -> OutputTensor:
    """The dequantized ``<m>.weight`` of the packed FP4 weight ``t`` (``<m>.weight_packed``), its
    scales (named into ``used``) checked against its shape; PlanError where they do not fit."""
    module = t.name.rpartition(".")[0]
    scale, gs = by_name.get(f"{module}.weight_scale"), by_name.get(f"{module}.weight_global_scale")
    spec = FP4_SCALES.get(scale.source.dtype) if scale is not None else None
    if t.source.dtype != "U8" or len(t.shape) != 2 or spec is None:
        raise PlanError(
            f"{t.name} is {t.source.dtype}{list(t.shape)}; packed FP4 needs U8 [rows, cols/2] with a "
            f"weight_scale beside it, F8_E4M3 (NVFP4) or U8 (MXFP4)"
        )
    kind, size, wants_global = spec
    rows, cols = t.shape[0], t.shape[1] * 2
    if tuple(scale.source.shape) != (rows, cols // size) or cols % size:
        raise PlanError(f"{scale.name} is {list(scale.source.shape)}; for {t.name} expected {[rows, cols // size]}")
    if wants_global != (gs is not None) or (gs is not None and (gs.source.dtype, gs.shape) != ("F32", (1,))):
        raise PlanError(
            f"{module}: NVFP4 (E4M3 scales) needs a weight_global_scale F32 [1] beside it, MXFP4 (U8 scales) none"
        )
    used.update(n.name for n in (scale, gs) if n is not None)
    transform = Fp4Dequant(scale.source, kind, gs.source if gs is not None else None)
    return OutputTensor(f"{module}.weight", t.source, out_dtype, transform=transform, out_shape=(rows, cols))
