"""Experts written as ``save_pretrained`` writes them (per expert), or fused as transformers
runs them: a plan's tensors renamed and re-cut by rows, never an [E, …] tensor held.

An output expert is rows of the fused source tensor (``select``: one index of its expert axis,
a row span for gate or up), read a chunk at a time like any tensor; a fused output is its
experts' references one after another (``concat``), its shape the [E, …] one.
"""

from __future__ import annotations

from dataclasses import replace

from streamck.errors import PlanError
from streamck.plan.compile import OutputTensor, Plan
from streamck.plan.moe.blocks import Block, find_blocks
from streamck.plan.moe.layout import DOWN, GATE_UP, Family
from streamck.plan.moe.scales import FUSED_SCALES, fused_scales, pick, refuse_other, scale_name, split_scales
from streamck.source.select import Rows, concat


def _one(ts: dict[str, OutputTensor], name: str, block: str, what: str) -> OutputTensor:
    if name not in ts:
        raise PlanError(f"MoE block {block}: {what} {name} is missing")
    return ts[name]


def check_router(ts: dict[str, OutputTensor], block: str, suffix: str, experts: int, extra: int = 0) -> None:
    """Refuse a router whose rows are not the expert count plus ``extra`` (rows for experts
    that are no tensors: LongCat's zero experts, Inkling's shared ones); a missing router too."""
    router = _one(ts, f"{block}.{suffix}", block, "router")
    if not router.shape or router.shape[0] != experts + extra:
        rows = experts + extra
        raise PlanError(f"MoE block {block}: router {router.name} has shape {list(router.shape)}, not {rows} rows")


def check_count(block: str, found: int, stated: int | None) -> None:
    """Refuse an expert count that differs from the config's."""
    if stated is not None and found != stated:
        raise PlanError(f"MoE block {block}: {found} experts, but config.json says {stated}")


def _fused_shapes(gu: OutputTensor, dn: OutputTensor, block: str, spare: int = 0) -> tuple[int, int]:
    """(E, I) of gate_up_proj [E + spare, 2I, H] and down_proj [E, H, I]; PlanError for any other shapes."""
    ok = len(gu.shape) == 3 and len(dn.shape) == 3 and gu.shape[1] % 2 == 0
    if ok:
        e, two_i, h = gu.shape
        ok = dn.shape == (e - spare, h, two_i // 2) and gu.dtype == dn.dtype
    if not ok:
        more = f" + {spare}" if spare else ""
        raise PlanError(
            f"MoE block {block}: experts.{GATE_UP} {list(gu.shape)} and experts.{DOWN} {list(dn.shape)} "
            f"are not [E{more}, 2I, H] and [E, H, I] of one dtype"
        )
    return gu.shape[0] - spare, gu.shape[1] // 2


def unfuse_block(
    ts: dict[str, OutputTensor], b: Block, fam: Family, stated: int | None, extra: int = 0, tile: int = 128
) -> list[OutputTensor]:
    """Block ``b``'s tensors (from ``ts`` by output name) under save_pretrained's names: fused
    experts split into per-expert rows where the family writes them so, their FP8 scales with
    them (``tile``: an FP8 tile's rows), renamed otherwise (``extra``: the router's rows beyond
    the experts)."""
    gu = _one(ts, f"{b.name}.experts.{GATE_UP}", b.name, "fused tensor")
    dn = _one(ts, f"{b.name}.experts.{DOWN}", b.name, "fused tensor")
    spare = extra if fam.gate_up_extra else 0
    experts, inter = _fused_shapes(gu, dn, b.name, spare) if fam.per_expert else (gu.shape[0], 0)
    check_count(b.name, experts, stated)
    check_router(ts, b.name, fam.router, experts, extra)
    disk = b.name[: len(b.name) - len(b.leaf)] + fam.disk_block if fam.block else b.name
    fused = {gu.name, dn.name, *(f"{b.name}.experts.{s}" for s in FUSED_SCALES)}
    out = []
    for name, t in ts.items():
        if name.startswith(b.name + ".") and (fam.experts is None or name not in fused):
            out.append(replace(t, name=f"{disk}.{fam.disk_suffix(name[len(b.name) + 1 :])}"))
    if not fam.per_expert:  # written fused, as it runs (renamed where the family's files name it otherwise)
        return out
    refuse_other({n: t for n, t in ts.items() if n not in fused}, b, "splitting the experts of")
    gate, up, down = fam.experts
    out += split_scales(ts, b, disk, inter, tile, fam.experts)
    for e in range(experts + spare):  # the spare ones (LongCat's zero experts): gate and up only
        pre = f"{disk}.experts.{e}"
        out.append(pick(gu, f"{pre}.{gate}.weight", Rows.span(0, inter), e))
        out.append(pick(gu, f"{pre}.{up}.weight", Rows.span(inter, 2 * inter), e))
        if e < experts:
            out.append(pick(dn, f"{pre}.{down}.weight", None, e))
    return out


def _experts_of(b: Block, fam: Family, stated: int | None) -> int:
    """The expert count of per-expert block ``b``: every projection of experts 0..E-1, E the
    config's where it states one (counted by down where gate and up have spare experts past
    E); PlanError naming what is missing."""
    projs = fam.experts or ()
    stray = sorted(set(b.experts) - set(projs))
    if stray:
        raise PlanError(f"MoE block {b.name}: experts.N.{stray[0]}.weight is not one of this family's {list(projs)}")
    counted = projs[2:] if fam.gate_up_extra else projs
    found = max((max(ids) + 1 for p, ids in b.experts.items() if ids and p in counted), default=0)
    want = stated if stated is not None else found
    for proj in projs:
        missing = sorted(set(range(want)) - set(b.experts.get(proj, {})))
        if missing:
            shown = ", ".join(str(e) for e in missing[:8]) + (" …" if len(missing) > 8 else "")
            raise PlanError(f"MoE block {b.name}: experts {shown} have no {proj}.weight ({want} experts)")
    check_count(b.name, found, stated)
    return want


def check_per_expert(ts: dict[str, OutputTensor], b: Block, fam: Family, stated: int | None, extra: int = 0) -> None:
    """Refuse a per-expert block with experts missing or a count or router that disagrees."""
    experts = _experts_of(b, fam, stated)
    router = fam.disk_suffix(fam.router)
    check_router(ts, b.name, router, experts, extra)


def _spares(ts: dict[str, OutputTensor], b: Block, fam: Family, experts: int, spare: int) -> list[list[OutputTensor]]:
    """Gate and up of the ``spare`` experts past ``experts`` that the fused gate/up holds rows
    for (LongCat's zero experts); PlanError where the files lack them."""
    gate, up, _ = fam.experts  # type: ignore[misc]
    lacking = [e for e in range(experts, experts + spare) if e not in b.experts[gate] or e not in b.experts[up]]
    if lacking:
        raise PlanError(
            f"MoE block {b.name}: experts {lacking[0]}..{experts + spare - 1} (past the {experts} routed ones) have "
            f"no {gate}/{up}.weight, which the fused {GATE_UP} holds rows for"
        )
    return [[ts[b.experts[p][e]] for p in (gate, up)] for e in range(experts, experts + spare)]


def fuse_block(
    ts: dict[str, OutputTensor], b: Block, fam: Family, stated: int | None, extra: int = 0, tile: int = 128
) -> list[OutputTensor]:
    """Per-expert block ``b`` under the runtime names transformers loads it to: experts fused
    into ``gate_up_proj`` [E, 2I, H] (gate, up per expert) and ``down_proj`` [E, H, I], their FP8
    scales fused with them (streamck.plan.moe.scales; ``tile``: an FP8 tile's rows)."""
    experts = _experts_of(b, fam, stated)
    check_router(ts, b.name, fam.disk_suffix(fam.router), experts, extra)
    gate, up, down = fam.experts  # type: ignore[misc]
    run = b.name[: len(b.name) - len(b.leaf)] + fam.block
    per = [[ts[b.experts[p][e]] for p in (gate, up, down)] for e in range(experts)]
    spares = _spares(ts, b, fam, experts, extra if fam.gate_up_extra else 0)
    spare = len(spares)
    dtypes = {t.dtype for ex in per + spares for t in ex}
    if len(dtypes) > 1:
        raise PlanError(f"MoE block {b.name}: experts would be written in several dtypes {sorted(dtypes)}")
    g, d = per[0][0], per[0][2]
    bad = [t.name for ex in per for t, want in zip(ex, (g, g, d), strict=True) if t.shape != want.shape]
    bad += [t.name for ex in spares for t in ex if t.shape != g.shape]
    if bad or len(g.shape) != 2 or d.shape != g.shape[::-1]:
        raise PlanError(f"MoE block {b.name}: {(bad or [d.name])[0]} does not stack with expert 0's shapes")
    inter, hidden = g.shape
    try:
        gu_ref = concat(f"{run}.experts.{GATE_UP}", [t.source for ex in per + spares for t in ex[:2]])
        dn_ref = concat(f"{run}.experts.{DOWN}", [ex[2].source for ex in per])
    except ValueError as e:  # dtypes or shapes of the sources disagree
        raise PlanError(f"MoE block {b.name}: {e}") from None
    dtype = g.dtype
    out = [
        OutputTensor(gu_ref.name, gu_ref._replace(shape=(experts + spare, 2 * inter, hidden)), dtype),
        OutputTensor(dn_ref.name, dn_ref._replace(shape=(experts, hidden, inter)), dtype),
    ]
    out += fused_scales(ts, per + spares, run, inter, tile)
    expert_names = {n for ids in b.experts.values() for n in ids.values()}
    expert_names |= {scale_name(n) for n in expert_names}
    refuse_other({n: t for n, t in ts.items() if n not in expert_names}, b, "{fuse_experts}")
    for name, t in ts.items():
        if name.startswith(b.name + ".") and name not in expert_names:
            out.append(replace(t, name=f"{run}.{fam.runtime_suffix(name[len(b.name) + 1 :])}"))
    return out


def blocks_of(plan: Plan) -> dict[str, Block]:
    """The plan's MoE blocks by output name."""
    return find_blocks(t.name for t in plan.tensors)
