"""Which top-level group of a training save is the model, one rule for every source.

Trainers save the model's weights as one group beside their training state: Lightning's
``.ckpt`` (``state_dict`` beside ``optimizer_states``, ``callbacks``, ``loops``,
``lr_schedulers``), its sharded FSDP / ModelParallel saves and Fabric's (``model`` or
``state_dict`` beside ``optimizer_0``…), ``get_state_dict`` saves and OLMo-core's
(``model`` beside ``optimizer`` / ``optim``). Where exactly one model group holds tensors
beside training state, that group is read by default, its prefix taken off, as ``--key``
would read it; ``--key '*'`` reads every group.
"""

from __future__ import annotations

import re

# Top-level groups that hold the model's weights.
MODEL_GROUPS = frozenset(("model", "state_dict"))
# Top-level items a trainer saves beside the weights (get_state_dict's "optimizer",
# torchtitan's "train_state", "lr_scheduler", "dataloader", Lightning's "optimizer_states",
# "callbacks", "loops", OLMo-core's "optim"); Lightning's sharded saves add "optimizer_N".
TRAINING_STATE = frozenset(
    (
        "optimizer",
        "optim",
        "optimizers",
        "optimizer_states",
        "lr_scheduler",
        "lr_schedulers",
        "scheduler",
        "train_state",
        "dataloader",
        "callbacks",
        "loops",
    )
)
_OPTIMIZER_N = re.compile(r"optimizer_\d+")
# The --key value that reads every group, the training state too.
ALL_KEY = "*"


def is_state(group: str) -> bool:
    """Whether the top-level group ``group`` (``optimizer_0``, ``app.optim``) is training state."""
    last = group.rsplit(".", 1)[-1]
    return last in TRAINING_STATE or _OPTIMIZER_N.fullmatch(last) is not None


def model_group(tensors: dict[str, int]) -> str | None:
    """The group read by default from groups by their tensor counts: the one model group
    (MODEL_GROUPS) holding tensors, when training state sits beside it; else None."""
    models = [g for g, n in tensors.items() if n and g.rsplit(".", 1)[-1] in MODEL_GROUPS]
    if len(models) == 1 and any(is_state(g) for g in tensors):
        return models[0]
    return None


def model_note(group: str, count: int, left: str) -> str:
    """The notice saying that ``group``'s ``count`` tensors were read as the model and what was not."""
    return (
        f"read the model: {count} tensors under {group!r}, that prefix taken off; left out: {left}; "
        f"--key '{ALL_KEY}' reads every group"
    )
