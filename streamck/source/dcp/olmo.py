"""OLMo-core trainer checkpoints, as its ``Checkpointer.save`` leaves them (OLMo-core 3.0).

A run's save folder holds one ``stepN/`` per save. Each holds ``model_and_optim/`` (DCP of
``{"model": ..., "optim": ...}`` written by OLMo-core's own FileSystemWriter, whose
``.metadata`` pickles its copy of the storage-info class), ``train/rankR.pt`` (the trainer's
state per rank, never read) and ``.metadata.json``. The step is read as its model: the
``model`` group (streamck.source.groups), the optimizer and ``train/`` left out with a note.
OLMo-core counts a folder as a checkpoint only when all three are there
(``Checkpointer.dir_is_checkpoint``); so does streamck, for ``--step`` as for a step given.
"""

from __future__ import annotations

import re
from pathlib import Path

from streamck.errors import CheckpointError

STEP_DIR = re.compile(r"^step(\d+)$")
MODEL_DIR = "model_and_optim"
METADATA_JSON = ".metadata.json"
TRAIN_DIR = "train"
# What Checkpointer.dir_is_checkpoint asks of a step folder.
REQUIRED = (Path(TRAIN_DIR, "rank0.pt"), Path(MODEL_DIR, ".metadata"), Path(METADATA_JSON))


def is_checkpoint(step: Path) -> bool:
    """Whether ``step`` is a finished OLMo-core step folder (every REQUIRED file there)."""
    return all((step / r).is_file() for r in REQUIRED)


def model_dir(path: Path) -> Path | None:
    """The DCP folder of an OLMo-core step folder ``path``, None when ``path`` is none.
    Raises CheckpointError for a step folder that is not finished."""
    if not (path / MODEL_DIR).is_dir():
        return None
    missing = [str(r) for r in REQUIRED if not (path / r).is_file()]
    if missing:
        raise CheckpointError(
            f"an OLMo-core step without {', '.join(missing)}: still being written or damaged; pick a finished one",
            path,
        )
    return path / MODEL_DIR


def left_beside(model: Path) -> list[str]:
    """The notice naming the trainer state beside an OLMo-core step's ``model_and_optim/``."""
    if model.name != MODEL_DIR or not (model.parent / TRAIN_DIR).is_dir():
        return []
    ranks = len(list((model.parent / TRAIN_DIR).glob("rank*.pt")))
    return [f"read {MODEL_DIR}/; left out beside it: {TRAIN_DIR}/ (the trainer's state, {ranks} rank files)"]
