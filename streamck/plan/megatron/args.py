"""Megatron's ``args`` and iteration, from a ``torch_dist`` checkpoint's ``common_state`` item.

``dist_checkpointing.save`` stores everything that is not a sharded tensor (the training
loop's ``args``, an ``argparse.Namespace``, and ``iteration``) as one DCP bytes item,
``common_state/shard_0_1``: a ``torch.save`` archive. It is unpickled under an allow-list:
the Namespace and Megatron's own enums become inert stand-ins holding what was pickled
(nothing of them runs), anything else outside plain data and tensors is refused.
"""

from __future__ import annotations

from pathlib import Path

from streamck.errors import CheckpointError, PlanError
from streamck.source.distcp import _Files
from streamck.source.distcp_meta import read_metadata
from streamck.source.reader import Reader
from streamck.source.torchzip import _WeightsOnly, load_archive
from streamck.source.zero_files import _stub

COMMON = "common_state"
PLAIN = (int, float, str, bool, type(None))


class _ArgsPickle(_WeightsOnly):
    """Tensors and plain data, plus inert stand-ins for the Namespace and Megatron's classes."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("argparse", "Namespace") or module == "megatron" or module.startswith("megatron."):
            return _stub(module, name)
        return super().find_class(module, name)


def _plain(value: object) -> bool:
    """Plain data: a PLAIN value, or a list of them (``moe_layer_freq`` as ``[0]*3+[1]*58`` parses)."""
    return isinstance(value, PLAIN) or (isinstance(value, list) and all(isinstance(v, PLAIN) for v in value))


def read_args(step: Path) -> tuple[dict, int | None]:
    """(the plain-valued fields of the saved ``args`` (lists of plain values too), the iteration); ({}, None) when the
    checkpoint holds no common state or no args. A refused or broken item is a PlanError."""
    saved = read_metadata(step)
    where = next((loc for name, loc in saved.objects.items() if name.split("/")[0] == COMMON and loc), None)
    if where is None:
        return {}, None
    with Reader() as pool:
        window = _Files(pool).blob(where, COMMON)
        try:
            common, *_ = load_archive(window, where.path, _ArgsPickle)
        except CheckpointError as e:
            raise PlanError(f"the {COMMON} item: {e.message}", where.path) from None
    if isinstance(common, list) and len(common) == 1:  # a ShardedObject of global shape (1,)
        common = common[0]
    if not isinstance(common, dict):
        return {}, None
    iteration = common.get("iteration")
    state = getattr(common.get("args"), "state", None)
    args = {k: v for k, v in state.items() if _plain(v)} if isinstance(state, dict) else {}
    return args, iteration if isinstance(iteration, int) else None
