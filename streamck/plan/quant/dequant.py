"""``--dtype`` on a quantized source: its weights dequantized as transformers 5.19 and
compressed-tensors 0.19 load them (streamck.transforms.dequantize), their scales dropped,
``quantization_config`` removed.

The native layouts read (the names in the checkpoint, as its producer writes them):

- FineGrainedFP8 / DeepSeek-V3 (``quant_method: fp8``): ``<m>.weight`` E4M3 beside
  ``<m>.weight_scale_inv`` (F32, BF16, or E8M0 with ``scale_fmt: ue8m0``), one scale per
  ``weight_block_size`` tile (128×128), partial last tiles included; fused experts
  ``<m>.gate_up_proj`` / ``down_proj`` [E, rows, cols] beside ``<m>.gate_up_proj_scale_inv`` [E, …]
  (transformers' FP8Experts, what ``--fuse-experts`` writes);
- compressed-tensors FP8 (``<m>.weight`` E4M3 beside ``<m>.weight_scale``): per tensor, per row,
  per group or per block, the strategy read from the config's ``config_groups``;
- compressed-tensors packed FP4 (``<m>.weight_packed`` U8 beside ``<m>.weight_scale``: E4M3 per 16
  values with ``<m>.weight_global_scale`` F32 [1] for NVFP4, U8 E8M0 per 32 values for MXFP4);
- gpt-oss MXFP4 (``quant_method: mxfp4``): ``<m>.experts.gate_up_proj_blocks`` / ``down_proj_blocks``
  U8 [E, R, G, 16] beside ``…_scales`` U8 [E, R, G], written as transformers' runtime
  ``gate_up_proj`` [E, H, 2I] / ``down_proj`` [E, I, H] (``modules_to_not_convert`` as stored).

Anything else quantized (integer packing, zero points, other methods) is refused by name, as are
scales that are missing, misshapen or without a weight.
"""

from __future__ import annotations

import json
from dataclasses import replace

from streamck.errors import PlanError, listing
from streamck.plan.compile import OutputTensor, Plan
from streamck.plan.quant.layout import output_config
from streamck.plan.quant.needs import require_torch
from streamck.transforms.dequantize import Fp4Dequant, Fp8Dequant
from streamck.transforms.dequantize_gptoss import GROUP_BYTES, Mxfp4ExpertsDequant, output_shape
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
# FineGrainedFP8's scale dtypes (E8M0: scale_fmt ue8m0, as transformers' quantizer writes it)
FP8_SCALE_DTYPES = ("F32", "BF16", "F16", "F8_E8M0")
# transformers' fused experts (FP8Experts) and gpt-oss's MXFP4 ones, by the projection's name
FUSED = ("gate_up_proj", "down_proj")
SCALE_NAMES = (*SCALES, *PACKED, *ACTIVATION, *(f"{p}_scale_inv" for p in FUSED), *(f"{p}_scales" for p in FUSED))


def _config(plan: Plan) -> dict:
    return output_config(plan, beside_source=True) or {}


def quantized_kind(plan: Plan) -> str | None:
    """ "fp8" (FineGrainedFP8 / DeepSeek-V3), "mxfp4" (gpt-oss), "compressed-tensors", or None for
    a source that is not quantized."""
    qc = _config(plan).get("quantization_config")
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    names = {ref.name.rpartition(".")[2] for ref in plan.source.tensors.values()}
    if method == "fp8" or "weight_scale_inv" in names or names & {f"{p}_scale_inv" for p in FUSED}:
        return "fp8"
    if method == "mxfp4" or names & {f"{p}_blocks" for p in FUSED}:
        return "mxfp4"
    if method is not None or names & {"weight_scale", *PACKED}:
        return str(method or "compressed-tensors")
    return None


def _grids(plan: Plan, kind: str) -> list[tuple[str, tuple[int, int] | None]]:
    """The weight strategies the config declares, each (strategy, its tile or group block):
    FineGrainedFP8's ``weight_block_size``; compressed-tensors' ``config_groups`` (empty where
    the config names none). PlanError for a format not dequantized here."""
    qc = _config(plan).get("quantization_config") or {}
    if kind == "fp8":
        size = qc.get("weight_block_size") or [128, 128]
        return [("block", (int(size[0]), int(size[1])))]
    groups = (qc.get("config_groups") or {}).values()
    formats = {g.get("format", qc.get("format")) for g in groups} | {qc.get("format")}
    formats.discard(None)
    unknown = formats - set(FORMATS)
    if unknown:
        raise PlanError(
            f"dequantizing {', '.join(sorted(unknown))} is not supported (only {', '.join(FORMATS)}); "
            "drop {dtype} to copy it as is"
        )
    found = []
    for g in groups:
        w = g.get("weights") or {}
        strategy = w.get("strategy")
        if strategy == "block" and w.get("block_structure"):
            found.append(("block", tuple(int(x) for x in w["block_structure"])))
        elif strategy == "group" and w.get("group_size"):
            found.append(("group", (1, int(w["group_size"]))))
        elif strategy in ("channel", "tensor"):
            found.append((strategy, None))
    return sorted(set(found), key=repr)


def _expected(strategy: str, block: tuple[int, int] | None, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The scale shapes ``strategy`` gives a weight of ``shape`` ([E,] rows, cols)."""
    *lead, rows, cols = shape
    if strategy == "tensor":
        return [(1,), (1, 1), ()]
    if strategy == "channel":
        return [(*lead, rows, 1)]
    return [(*lead, -(-rows // block[0]), -(-cols // block[1]))]  # type: ignore[index]


def _fp8_scale(t: OutputTensor, by_name: dict[str, OutputTensor], kind: str) -> OutputTensor:
    """The scale beside FP8 weight ``t`` (``<m>.weight_scale_inv``/``weight_scale``, a fused
    ``<m>.gate_up_proj_scale_inv``); PlanError naming what is missing."""
    module, _, param = t.name.rpartition(".")
    suffix = "weight_scale_inv" if kind == "fp8" else "weight_scale"
    if param == "weight" and len(t.shape) == 2:
        name = f"{module}.{suffix}"
    elif kind == "fp8" and param in FUSED and len(t.shape) == 3:
        name = f"{t.name}_scale_inv"
    else:
        raise PlanError(f"{t.name} is {t.source.dtype}{list(t.shape)}: not a weight this {kind} layout dequantizes")
    if name not in by_name:
        raise PlanError(f"{t.name} is {t.source.dtype}{list(t.shape)} without a {name} beside it; cannot dequantize")
    return by_name[name]


def _fp8(t: OutputTensor, by_name: dict, kind: str, grids: list, out_dtype: str, used: set[str]) -> OutputTensor:
    """The dequantized FP8 weight ``t``, its scale (named into ``used``) checked against the
    config's strategies; PlanError where it fits none."""
    scale = _fp8_scale(t, by_name, kind)
    shape = tuple(scale.source.shape)
    if kind == "fp8" and scale.source.dtype not in FP8_SCALE_DTYPES:
        dtypes = ", ".join(FP8_SCALE_DTYPES)
        raise PlanError(f"{scale.name} is {scale.source.dtype}; FineGrainedFP8 scales are {dtypes}")
    fits = [(s, b) for s, b in grids if shape in _expected(s, b, t.shape)]
    if not grids and kind != "fp8":  # a config naming no strategy: the scale's shape says it
        fits = [(s, None) for s in ("tensor", "channel") if shape in _expected(s, None, t.shape)]
    if not fits:
        want = _expected(*grids[0], t.shape)[0] if grids else (t.shape[0], 1)
        said = f" ({grids[0][0]} {list(grids[0][1] or ())}, as the config says)" if grids else ""
        raise PlanError(f"{scale.name} is {list(shape)}; for {t.name} {list(t.shape)} expected {list(want)}{said}")
    strategy, block = fits[0]
    used.add(scale.name)
    transform = Fp8Dequant(scale.source, kind, block if strategy in ("block", "group") else (1, 1))
    return OutputTensor(t.name, t.source, out_dtype, transform=transform)


def dequantize_plan(plan: Plan, dtype: str) -> Plan:
    """``plan`` (compiled with ``--dtype dtype``) with every FP8 and FP4 weight dequantized
    into ``dtype``, its scales and activation scales dropped, and ``quantization_config`` out of
    config.json. Raises PlanError for a layout it cannot dequantize (nothing is approximated)."""
    kind = quantized_kind(plan)
    if kind not in ("fp8", "compressed-tensors", "mxfp4"):
        raise PlanError(
            f"the source is {kind}-quantized; dequantizing it is not supported (FineGrainedFP8, gpt-oss "
            "MXFP4 and compressed-tensors FP8, NVFP4 and MXFP4 only)"
        )
    require_torch(f"dequantizing this {kind} checkpoint ({{dtype}} {dtype})")
    grids = _grids(plan, kind) if kind != "mxfp4" else []
    by_name = {t.name: t for t in plan.tensors}
    zero = [n for n in by_name if n.endswith(".weight_zero_point")]
    if zero:
        raise PlanError(f"asymmetric weights ({listing(zero, 3)}): dequantizing zero points is not supported")
    out_dtype = plan_dtype(plan, dtype)
    tensors, used, counts = [], set(), {"fp8": 0, "fp4": 0, "mxfp4": 0}
    for t in plan.tensors:
        param = t.name.rpartition(".")[2]
        if param in SCALE_NAMES and param != "weight_packed":
            continue
        if param.endswith("_blocks") and param[: -len("_blocks")] in FUSED:
            tensors.append(_gptoss(t, by_name, out_dtype, used))
            counts["mxfp4"] += 1
        elif param == "weight_packed":
            tensors.append(_fp4(t, by_name, out_dtype, used))
            counts["fp4"] += 1
        elif t.source.dtype == "F8_E4M3":
            tensors.append(_fp8(t, by_name, kind, grids, out_dtype, used))
            counts["fp8"] += 1
        else:
            tensors.append(t)
    stray = [n for n in by_name if n.rpartition(".")[2] in SCALE_NAMES and n not in used]
    stray = [n for n in stray if n.rpartition(".")[2] not in (*ACTIVATION, "weight_packed")]
    if stray:
        raise PlanError(f"scales without a quantized weight beside them: {listing(stray, 3)}")
    return _finished(plan, tensors, counts, kind, out_dtype)


def _finished(plan: Plan, tensors: list[OutputTensor], counts: dict[str, int], kind: str, out_dtype: str) -> Plan:
    """The dequantized plan: its tensors, config.json without quantization_config, a summary."""
    side = dict(plan.side_files)
    config = _config(plan)
    summary = []
    if counts["fp8"]:
        summary.append(f"dequantizing {counts['fp8']} FP8 weights ({kind}) to {out_dtype}, as transformers loads them")
    if counts["fp4"]:
        summary.append(
            f"dequantizing {counts['fp4']} packed FP4 weights to {out_dtype}, as compressed-tensors' decompressor "
            "does (to bf16, then cast)"
        )
    if counts["mxfp4"]:
        summary.append(
            f"dequantizing {counts['mxfp4']} gpt-oss MXFP4 expert tensors to {out_dtype}, as transformers' "
            "Mxfp4Config(dequantize=True) loads them (to bf16, then cast)"
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


def _gptoss(t: OutputTensor, by_name: dict[str, OutputTensor], out_dtype: str, used: set[str]) -> OutputTensor:
    """gpt-oss's ``<m>.<proj>_blocks`` [E, R, G, 16] with ``<m>.<proj>_scales`` [E, R, G] (U8 both)
    as the runtime ``<m>.<proj>`` [E, G × 32, R]; PlanError naming what does not fit."""
    name = t.name[: -len("_blocks")]
    shape = tuple(t.source.shape)
    if t.source.dtype != "U8" or len(shape) != 4 or shape[3] != GROUP_BYTES:
        raise PlanError(f"{t.name} is {t.source.dtype}{list(shape)}; gpt-oss MXFP4 blocks are U8 [E, rows, groups, 16]")
    scale = by_name.get(f"{name}_scales")
    if scale is None:
        raise PlanError(f"{t.name} has no {name}_scales beside it; cannot dequantize")
    if (scale.source.dtype, tuple(scale.source.shape)) != ("U8", shape[:3]):
        raise PlanError(f"{scale.name} is {scale.source.dtype}{list(scale.source.shape)}; for {t.name} "
                        f"expected U8{list(shape[:3])}")  # fmt: skip
    used.add(scale.name)
    return OutputTensor(name, t.source, out_dtype, transform=Mxfp4ExpertsDequant(scale.source),
                        out_shape=output_shape(shape))  # fmt: skip


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
