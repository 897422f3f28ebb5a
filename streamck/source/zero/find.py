"""Which folder holds a DeepSpeed save, and DeepSpeed's file names: ``global_stepN/`` holds one
``*zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per data-parallel rank, beside the model
states (one per rank under ZeRO-3, ``mp_rank_00_model_states.pt`` under ZeRO-1/2)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from streamck.errors import CheckpointError
from streamck.storage import UrlPath, location

OPTIM_RE = re.compile(r"^(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
Z3_MODEL_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
MODEL_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
MOE_RE = re.compile(r"(^|_)expert_\d+_.*model_states\.pt$|^expp_rank_\d+_.*optim_states\.pt$")


def find_zero(path: Path) -> Path | None:
    """The step folder holding ZeRO state: ``path`` itself (``global_stepN/``), the one its
    ``latest`` file names (``checkpoint-N/``), or, with no ``latest``, its only folder
    holding ZeRO state; None when ``path`` is none of these.

    Raises CheckpointError when ``latest`` names something else, or when there is no
    ``latest`` and several folders hold ZeRO state (which one is the model is a guess).
    """
    path = location(path)
    if not path.is_dir():
        return None
    if _has_zero(path):
        return path
    latest = path / "latest"
    if latest.is_file():
        try:
            tag = latest.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"cannot read: {e}", latest) from None
        if not tag or "/" in tag or "\\" in tag or tag in (".", ".."):
            raise CheckpointError(f"names {tag!r}, not a step folder", latest)
        if not _has_zero(path / tag):
            raise CheckpointError(f"names {tag}, which holds no ZeRO optimizer state", latest)
        return path / tag
    # DeepSpeed's own tag is global_step<N>: only those folders are looked into (a DCP
    # folder beside them may hold thousands of files)
    if isinstance(path, UrlPath):
        named = [p for p in path.iterdir() if p.name.startswith("global_step") and p.is_dir()]
    else:
        with os.scandir(path) as it:
            named = [Path(e.path) for e in it if e.name.startswith("global_step") and e.is_dir()]
    found = sorted((p for p in named if _has_zero(p)), key=_step_order)
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise CheckpointError(
            f"no 'latest' file and {len(found)} folders of ZeRO state ({names}): "
            f"give the one to read, e.g. {path / found[-1].name}",
            path,
        )
    return found[0] if found else None


def _step_order(path: Path) -> tuple[int, str]:
    m = re.search(r"(\d+)$", path.name)
    return (int(m[1]) if m else -1, path.name)


def _has_zero(path: Path) -> bool:
    return path.is_dir() and any(OPTIM_RE.match(p.name) for p in path.iterdir())


def rank_file_error(path: Path) -> CheckpointError | None:
    """The error for ``path`` when it is one rank's file of a ZeRO checkpoint, given alone."""
    if OPTIM_RE.match(path.name) or Z3_MODEL_RE.match(path.name) or MODEL_RE.match(path.name):
        return CheckpointError(f"one rank's file of a DeepSpeed ZeRO checkpoint: pass its folder, {path.parent}", path)
    return None
