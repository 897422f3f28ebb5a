"""Experts' FP8 scales moved with their weights: ``--fuse-experts`` and the per-expert split carry
each weight's ``weight_scale_inv`` (FineGrainedFP8 / DeepSeek-V3's layout) into the layout of the
weights, so dequantizing the result equals doing the same to the dequantized model. Never fused
weights beside per-expert scales, nor the reverse: what cannot move is refused in one line.

Fused, transformers' FP8Experts holds ``experts.gate_up_proj_scale_inv`` [E, 2I/bh, H/bw] (expert
e's gate tiles, then its up tiles) and ``experts.down_proj_scale_inv`` [E, ⌈H/bh⌉, ⌈I/bw⌉] beside
the fused weights; per expert, ``experts.e.<gate>.weight_scale_inv`` [I/bh, ⌈H/bw⌉] and so on. The
gate/up tiles are the fused tensor's only where I is a multiple of the tile's rows ``bh`` (else
gate's last tile would hold up's first rows): other sizes are refused.
"""

from __future__ import annotations

from streamck.errors import PlanError
from streamck.plan.compile import OutputTensor
from streamck.plan.moe.blocks import Block
from streamck.plan.moe.layout import DOWN, GATE_UP
from streamck.source.select import Rows, concat, select

SCALE = "weight_scale_inv"
FUSED_SCALES = (f"{GATE_UP}_scale_inv", f"{DOWN}_scale_inv")
# quantization tensors no fused layout holds (compressed-tensors', packed FP4's, gpt-oss's)
OTHER = ("weight_scale", "weight_packed", "weight_global_scale", "weight_zero_point", "input_scale")
OTHER_FUSED = ("_scale", "_scales", "_blocks", "_packed", "_global_scale", "_input_scale", "_activation_scale")
DEQUANTIZE_FIRST = "dequantize them first ({dtype} bf16), then fuse or split the dequantized checkpoint"


def tile_rows(config: dict) -> int:
    """The rows of a FineGrainedFP8 tile (``weight_block_size[0]``, 128 by default)."""
    qc = config.get("quantization_config")
    size = qc.get("weight_block_size") if isinstance(qc, dict) else None
    return int(size[0]) if isinstance(size, list | tuple) and size else 128


def scale_name(weight: str) -> str:
    """``…experts.e.gate_proj.weight`` -> ``…experts.e.gate_proj.weight_scale_inv``."""
    return weight + "_scale_inv"


def refuse_other(ts: dict[str, OutputTensor], b: Block, action: str) -> None:
    """PlanError where block ``b`` holds quantization tensors no fused layout carries."""
    under = sorted(n for n in ts if n.startswith(f"{b.name}.experts."))
    other = [n for n in under if n.rpartition(".")[2] in OTHER or n.endswith(OTHER_FUSED)]
    if other:
        raise PlanError(f"{action} {b.name}: its experts are quantized ({other[0]}); {DEQUANTIZE_FIRST}")


def fused_scales(
    ts: dict[str, OutputTensor], per: list[list[OutputTensor]], run: str, inter: int, tile: int
) -> list[OutputTensor]:
    """For ``--fuse-experts``: the fused scales of experts ``per`` ([gate, up, down] weights each,
    spare experts' [gate, up] after them): [] where none has a scale; PlanError where some do not,
    or where gate/up tiles would straddle the fused tensor's."""
    names = [[scale_name(t.name) for t in ex] for ex in per]
    have = [n for ex in names for n in ex if n in ts]
    if not have:
        return []
    lacking = [n for ex in names for n in ex if n not in ts]
    if lacking:
        raise PlanError(f"{{fuse_experts}}: {lacking[0]} is missing (its expert's others have scales)")
    if inter % tile:
        raise PlanError(
            f"{{fuse_experts}}: {run}'s gate/up ({inter} rows) is no multiple of the {tile}-row FP8 tile, so their "
            f"scales cannot be fused; {DEQUANTIZE_FIRST}"
        )
    gu = [ts[n].source for ex in names for n in ex[:2]]
    dn = [ts[ex[2]].source for ex in names if len(ex) == 3]
    try:
        gu_ref, dn_ref = concat(f"{run}.experts.{FUSED_SCALES[0]}", gu), concat(f"{run}.experts.{FUSED_SCALES[1]}", dn)
    except ValueError as e:
        raise PlanError(f"{{fuse_experts}} {run}: {e}") from None
    g, d = gu[0].shape, dn[0].shape
    if len(g) != 2 or len(d) != 2 or any(s.shape != g for s in gu) or any(s.shape != d for s in dn):
        raise PlanError(f"{{fuse_experts}} {run}: the experts' {SCALE} shapes differ")
    return [
        OutputTensor(gu_ref.name, gu_ref._replace(shape=(len(per), 2 * g[0], g[1])), ts[names[0][0]].dtype),
        OutputTensor(dn_ref.name, dn_ref._replace(shape=(len(dn), *d)), ts[names[0][2]].dtype),
    ]


def split_scales(
    ts: dict[str, OutputTensor], b: Block, disk: str, inter: int, tile: int, names: tuple[str, str, str]
) -> list[OutputTensor]:
    """For the per-expert split: each expert's ``weight_scale_inv`` from fused block ``b``'s, under
    ``disk`` (the block's disk name; ``names``: gate, up and down's), [] where it has none; PlanError
    where only one is there or gate/up tiles cannot be told apart."""
    gu, dn = (ts.get(f"{b.name}.experts.{s}") for s in FUSED_SCALES)
    if gu is None and dn is None:
        return []
    if gu is None or dn is None or len(gu.shape) != 3 or len(dn.shape) != 3:
        raise PlanError(f"MoE block {b.name}: experts.{FUSED_SCALES[0]} and {FUSED_SCALES[1]} go together, [E, …] each")
    half = gu.shape[1] // 2
    if inter % tile or gu.shape[1] != 2 * half or half * tile != inter:
        raise PlanError(
            f"MoE block {b.name}: {gu.name} {list(gu.shape)} cannot be split into gate and up tiles "
            f"({inter} rows each, {tile}-row tiles); {DEQUANTIZE_FIRST}"
        )
    gate, up, down = names
    out = []
    for e in range(gu.shape[0]):
        pre = f"{disk}.experts.{e}"
        for proj, ref, rows in ((gate, gu, Rows.span(0, half)), (up, gu, Rows.span(half, 2 * half))):
            out.append(pick(ref, f"{pre}.{proj}.{SCALE}", rows, e))
        if e < dn.shape[0]:
            out.append(pick(dn, f"{pre}.{down}.{SCALE}", None, e))
    return out


def pick(t: OutputTensor, name: str, rows: Rows | None, index: int) -> OutputTensor:
    """Expert ``index`` of fused ``t`` (``rows`` of it) as output ``name``."""
    label = f"{t.source.name}[{index}]" + (f"[{rows.start}:{rows.start + rows.count}]" if rows else "")
    return OutputTensor(name, select(t.source, rows, index=index, name=label), t.dtype)
