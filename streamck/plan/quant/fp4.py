"""NVFP4A16 and MXFP4A16 in a plan: each target weight's outputs (compressed-tensors' names, dtypes
and shapes) and, for NVFP4, the tensors that share its global scale.

A weight becomes ``weight_packed`` U8 [rows, cols/2] and ``weight_scale`` [rows, cols/group]
(E4M3 for NVFP4, E8M0 exponents as U8 for MXFP4); NVFP4 adds ``weight_global_scale`` F32 [1].
NVFP4's global scale is shared by the tensors of one fused set (layout.FUSED: a layer's q/k/v,
a dense MLP's gate/up), where all of the set is in the checkpoint, whichever files they sit in
(model_free_ptq crashes on some shardings; the result here is what it gives on the others); the
set's ignored tensors are left out of it, as model_free_ptq leaves them.
"""

from __future__ import annotations

import re

from streamck.plan.compile import OutputTensor
from streamck.plan.quant.layout import FUSED
from streamck.transforms.fp4 import GROUP, Fp4, Member

KIND = {"tensor_group": "nv", "group": "mx"}


def fp4_unfit(targets: list[OutputTensor], strategy: str) -> tuple[str, list[str]]:
    """What an FP4 scheme takes, and the targets it cannot (columns no multiple of the group:
    model_free_ptq refuses them too); nothing for the other strategies."""
    if strategy not in KIND:
        return "", []
    size = GROUP[KIND[strategy]]
    return f"weights whose columns are a multiple of {size}", [
        f"{t.name} ({t.dtype}{list(t.shape)})" for t in targets if t.shape[1] % size
    ]


def fused_sets(names: set[str]) -> list[tuple[str, ...]]:
    """The complete fused sets among ``names`` (every tensor of the checkpoint): primary first."""
    sets = []
    for name in sorted(names):
        for pattern, partners in FUSED:
            found = re.match(pattern, name)
            if found is not None:
                members = (name, *(p.format(**found.groupdict()) for p in partners))
                if all(m in names for m in members):
                    sets.append(members)
    return sets


def fp4_outputs(targets: list[OutputTensor], strategy: str, names: set[str]) -> list[OutputTensor]:
    """Every target's FP4 outputs, computed from its source (or what its transform computes)."""
    kind = KIND[strategy]
    by_name = {t.name: t for t in targets}
    shared: dict[str, tuple[str, ...]] = {}
    if kind == "nv":
        for members in fused_sets(names):
            group = tuple(m for m in members if m in by_name)
            shared.update({m: group for m in group})
    out = []
    for t in targets:
        group = tuple(Member(n, by_name[n].source, by_name[n].transform) for n in shared.get(t.name, (t.name,)))
        out.extend(_outputs(t, kind, group))
    return out


def _outputs(t: OutputTensor, kind: str, group: tuple[Member, ...]) -> list[OutputTensor]:
    rows, cols = t.shape
    module = t.name.rpartition(".")[0]
    inner = t.transform  # a LoRA merge: its output is what is quantized, in the same pass

    def part(name: str, dtype: str, shape: tuple[int, ...]) -> OutputTensor:
        transform = Fp4(name, kind, t.dtype, group if kind == "nv" else (), inner)
        suffix = {"packed": "weight_packed", "scale": "weight_scale", "global": "weight_global_scale"}[name]
        return OutputTensor(f"{module}.{suffix}", t.source, dtype, transform=transform, out_shape=shape)

    outs = [
        part("packed", "U8", (rows, cols // 2)),
        part("scale", "F8_E4M3" if kind == "nv" else "U8", (rows, cols // GROUP[kind])),
    ]
    return [*outs, part("global", "F32", (1,))] if kind == "nv" else outs
