"""Hugging Face Trainer + FSDP checkpoints, as accelerate's ``save_fsdp_model`` leaves them.

In ``checkpoint-N/`` (accelerate/utils/fsdp_utils.py, per ``fsdp_state_dict_type``):

- SHARDED_STATE_DICT: ``pytorch_model_fsdp_0/``, torch DCP of ``{"model": state_dict}``
  beside the optimizer's ``optimizer_0/``. Read as the model: DCP's ``--key model``, the
  ``model.`` group with its prefix removed, which gives the names ``save_pretrained`` writes.
- FULL_STATE_DICT: ``pytorch_model_fsdp.bin``, a ``torch.save`` of the full state dict
  (beside ``optimizer.bin``); it matches ``pytorch_model*.bin`` and is read as a torch zip.
- LOCAL_STATE_DICT (FSDP1 only) and SHARDED_STATE_DICT with ``use_dcp=False``: one
  ``torch.save`` per rank (``pytorch_model_fsdp[_I]_rank{R}.bin``), refused: FSDP1's local
  files hold each rank's slice of flattened, padded parameters, whose layout is not saved;
  the per-rank SHARDED files hold pickled DTensors (objects, not a tensor state dict).
"""

from __future__ import annotations

import re
from pathlib import Path

from streamck.errors import CheckpointError, listing

MODEL_DIR = re.compile(r"^pytorch_model_fsdp_(\d+)$")
FULL_FILE = "pytorch_model_fsdp.bin"
RANK_FILE = re.compile(r"^pytorch_model_fsdp(_\d+)?_rank\d+\.bin$")
MODEL_KEY = "model"  # save_fsdp_model's one top-level item
METADATA = ".metadata"
# What accelerate writes beside the model, never read: its optimizer state.
OPTIMIZER = ("optimizer_0", "optimizer.bin")


def model_dir(path: Path) -> Path | None:
    """The SHARDED_STATE_DICT model folder for ``path``: ``path`` itself when it is a
    ``pytorch_model_fsdp_<I>/`` DCP folder, else ``path/pytorch_model_fsdp_0/``; None when
    there is none."""
    if MODEL_DIR.match(path.name) and (path / METADATA).is_file():
        return path
    first = path / "pytorch_model_fsdp_0"
    return first if (first / METADATA).is_file() else None


def full_alone(shards: list[Path]) -> bool:
    """Whether the weights found are FULL_STATE_DICT's ``pytorch_model_fsdp.bin`` alone."""
    return [s.name for s in shards] == [FULL_FILE]


def rank_file_error(path: Path) -> CheckpointError | None:
    """The error for ``path`` when it is one rank's file of an FSDP checkpoint saved per rank."""
    m = RANK_FILE.match(path.name)
    if m is None:
        return None
    # accelerate names LOCAL_STATE_DICT files of model 0 without its index, use_dcp=False's
    # SHARDED_STATE_DICT files always with it: model 1's files may be either.
    local = "FSDP1's LOCAL_STATE_DICT (flattened, padded parameter slices whose layout is not saved)"
    sharded = "a SHARDED_STATE_DICT saved per rank (use_dcp=False: pickled DTensor shards, not read)"
    how = {None: local, "_0": sharded}.get(m.group(1), f"{local} or {sharded}")
    return CheckpointError(
        f"one rank's FSDP file, {how}: streamck cannot rebuild the model from these; save with "
        "fsdp_config state_dict_type SHARDED_STATE_DICT (DCP) or FULL_STATE_DICT",
        path,
    )


def rank_files_error(directory: Path) -> CheckpointError | None:
    """The error for a folder whose only weights are per-rank FSDP files."""
    found = sorted(p for p in directory.glob("pytorch_model_fsdp*_rank*.bin") if RANK_FILE.match(p.name))
    return rank_file_error(found[0]) if found else None


def read_fsdp(directory: Path) -> tuple[dict, list[str]]:
    """Index the model in a SHARDED_STATE_DICT folder (``pytorch_model_fsdp_<I>/``) by tensor,
    with the names ``save_pretrained`` writes; notices say what was left out beside it."""
    from streamck.source.dcp.native import read_distcp

    entries, notices = read_distcp(directory, MODEL_KEY)
    return entries, notices + left_beside(directory.parent, directory.name)


def left_beside(checkpoint: Path, read: str) -> list[str]:
    """A notice naming what in ``checkpoint`` is not read beside ``read`` (the model that is):
    the optimizer's state and other models' folders."""
    skipped = [f"{n} (optimizer state)" for n in OPTIMIZER if (checkpoint / n).exists()]
    models = sorted(p.name for p in checkpoint.glob("pytorch_model_fsdp_*") if MODEL_DIR.match(p.name))
    skipped += [f"{n} (another model)" for n in models if n != read]
    return [f"read {read}; left out beside it: {listing(skipped, 4)}"] if skipped else []
