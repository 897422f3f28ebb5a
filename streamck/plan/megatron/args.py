"""Megatron's ``args`` and iteration, from a ``torch_dist`` checkpoint's ``common_state`` item.

``dist_checkpointing.save`` stores everything that is not a sharded tensor (the training
loop's ``args``, an ``argparse.Namespace``, and ``iteration``) as one DCP bytes item,
``common_state/shard_0_1``: a ``torch.save`` archive. It is unpickled under an allow-list:
the Namespace, Megatron's own enums and the standard library's enums its parser stores
(``args.exit_signal`` is a ``signal.Signals``) become inert stand-ins holding what was pickled
(nothing of them runs); ``torch.dtype``s are read by name (torchzip); anything else outside
plain data and tensors is refused, by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from streamck.errors import CheckpointError, PlanError
from streamck.source.dcp.metadata import read_metadata
from streamck.source.dcp.native import Files
from streamck.source.reader import Reader
from streamck.source.torchzip.archive import load_archive
from streamck.source.torchzip.inert import stub
from streamck.source.torchzip.unpickle import WeightsOnly

COMMON = "common_state"
PLAIN = (int, float, str, bool, type(None))
# Standard-library enums Megatron-LM's argument parser stores (``--exit-signal``): read as their values.
STDLIB_ENUMS = {("signal", "Signals"), ("signal", "Handlers")}


class _ArgsPickle(WeightsOnly):
    """Tensors and plain data, plus inert stand-ins for the Namespace and Megatron's classes."""

    def find_class(self, module: str, name: str):
        megatron = module == "megatron" or module.startswith("megatron.")
        if (module, name) == ("argparse", "Namespace") or megatron or (module, name) in STDLIB_ENUMS:
            return stub(module, name)
        return super().find_class(module, name)


def _plain(value: object) -> bool:
    """Plain data: a PLAIN value, or a list of them (``moe_layer_freq`` as ``[0]*3+[1]*58`` parses)."""
    return isinstance(value, PLAIN) or (isinstance(value, list) and all(isinstance(v, PLAIN) for v in value))


class Common(NamedTuple):
    """What a step holds beside its model tensors, as read from its metadata and common state."""

    args: dict  # the plain-valued fields of the saved ``args`` (lists of plain values too)
    iteration: int | None
    beside: list[str]  # the common state's other entries (optimizer, opt_param_scheduler…)
    objects: list[str]  # every non-tensor item of the step (``rng_state/shard_0.0_2.1``…)


def read_args(step: Path) -> tuple[dict, int | None]:
    """(the plain-valued fields of the saved ``args`` (lists of plain values too), the iteration); ({}, None) when the
    checkpoint holds no common state or no args. A refused or broken item is a PlanError."""
    common = read_common(step)
    return common.args, common.iteration


def read_common(step: Path) -> Common:
    """The step's ``args``, iteration and what else lies beside the model (read_args says which args)."""
    saved = read_metadata(step)
    objects = list(saved.objects)
    where = next((loc for name, loc in saved.objects.items() if name.split("/")[0] == COMMON and loc), None)
    if where is None:
        return Common({}, None, [], objects)
    with Reader() as pool:
        window = Files(pool).blob(where, COMMON)
        try:
            common, *_ = load_archive(window, where.path, _ArgsPickle)
        except CheckpointError as e:
            raise PlanError(f"the {COMMON} item: {e.message}", where.path) from None
    if isinstance(common, list) and len(common) == 1:  # a ShardedObject of global shape (1,)
        common = common[0]
    if not isinstance(common, dict):
        return Common({}, None, [], objects)
    iteration = common.get("iteration")
    state = getattr(common.get("args"), "state", None)
    args = {k: v for k, v in state.items() if _plain(v)} if isinstance(state, dict) else {}
    beside = [str(k) for k in common if k not in ("args", "iteration", "checkpoint_version", "content_metadata")]
    return Common(args, iteration if isinstance(iteration, int) else None, beside, objects)
