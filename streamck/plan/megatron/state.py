"""What a Megatron step holds beside the model, named in the note on what a conversion leaves out.

Megatron-LM's ``save_checkpoint`` (``torch_dist``) writes, beside the model's tensors: the
optimizer's tensors (``optimizer.state.exp_avg…``), one ``rng_state`` and one
``rerun_state_machine_state`` object per rank, every linear layer's ``_extra_state`` (FP8 scaling
state, also when unused) and, in the ``common_state`` item beside ``args``, the optimizer's param
groups, the LR scheduler and the rerun state machine.
"""

from __future__ import annotations

from streamck.errors import listing
from streamck.plan.megatron.args import COMMON, Common

EXTRA = "._extra_state"


def state_note(common: Common, others: list[str], written: int) -> str:
    """The one note: ``written`` model tensors, then each kind of state left out, with its count
    (``others``: the step's tensors that are not the model's)."""
    tensors: dict[str, list[str]] = {}
    for name in others:
        tensors.setdefault(name.split("/")[0].split(".")[0], []).append(name)
    parts = [f"{g} state ({len(ns)} tensors: {_kinds(ns)})" for g, ns in tensors.items()]
    objects: dict[str, set[str]] = {}
    for name in common.objects:
        base, _, shard = name.partition("/")
        objects.setdefault(base, set()).add(shard)
    extra = sorted(b[: -len(EXTRA)].rsplit(".", 1)[-1] for b in objects if b.endswith(EXTRA))
    for base, shards in objects.items():
        if base != COMMON and not base.endswith(EXTRA):
            parts.append(f"{base} ({len(shards)} per-rank item{'s' * (len(shards) > 1)})")
    if extra:
        parts.append(f"every linear's _extra_state ({listing(extra)})")
    if common.beside:
        parts.append(f"beside args in {COMMON}: {', '.join(common.beside)}")
    return f"{written} model tensors to write" + (f"; left out: {'; '.join(parts)}" if parts else "")


def _kinds(names: list[str]) -> str:
    """The last parts of the names (``exp_avg``, ``exp_avg_sq``, ``fp32_param``), each once."""
    kinds = sorted({n.split("/")[0].split(".")[2] if n.count(".") > 2 else n for n in names})
    return listing(kinds, 4)
