"""The step folders of a training run root and the one a run marks as latest, by trainer."""

from __future__ import annotations

import re
from pathlib import Path

from streamck.errors import CheckpointError
from streamck.source.dcp import olmo

# The step folders of a training run root, by the trainer that writes them; the group is the
# step number. (DeepSpeed's global_stepN sits inside Trainer's checkpoint-N: not a run's step.)
STEP_DIRS = {
    "checkpoint-N": (r"checkpoint-(\d+)", "HF Trainer"),
    "epoch_E_step_S": (r"epoch_\d+_step_(\d+)", "NeMo Automodel"),
    "iter_NNNNNNN": (r"iter_(\d+)", "Megatron"),
    "step-N": (r"step-(\d+)", "torchtitan"),
    "global_step_N": (r"global_step_(\d+)", "verl"),
    "stepN": (r"step(\d+)", "OLMo-core"),
}
STEP_DIR = re.compile("^(?:" + "|".join(pattern for pattern, _ in STEP_DIRS.values()) + ")$")
# Where a run records its latest step: Automodel's LATEST link or LATEST.txt (a folder name);
# Megatron's and verl's tracker (a step number).
LATEST_LINK, LATEST_NAME, LATEST_NUMBER = "LATEST", "LATEST.txt", "latest_checkpointed_iteration.txt"
# torchtitan keeps its steps in checkpoint/ under the run's dump folder.
TITAN_STEPS = "checkpoint"


def steps(path: Path) -> dict[int, Path]:
    """The step folders directly in ``path`` (STEP_DIRS), or in its torchtitan ``checkpoint/``, by
    step; OLMo-core's ``stepN`` only when finished, as OLMo-core counts them (streamck.source.dcp.olmo)."""
    found = {}
    for child in path.iterdir():
        m = STEP_DIR.match(child.name)
        if m and child.is_dir() and (not olmo.STEP_DIR.match(child.name) or olmo.is_checkpoint(child)):
            found[int(next(g for g in m.groups() if g is not None))] = child
    if not found and (path / TITAN_STEPS).is_dir():
        return steps(path / TITAN_STEPS)
    return dict(sorted(found.items()))


def _latest(path: Path, found: dict[int, Path]) -> tuple[Path, str]:
    """What the run says is latest, and how that is known: Automodel's ``LATEST`` link or
    ``LATEST.txt``, Megatron's and verl's tracker file, else the highest step number."""
    if (path / LATEST_LINK).is_dir():
        return (path / LATEST_LINK).resolve(), LATEST_LINK
    if (path / LATEST_NAME).is_file():
        name = _marker(path / LATEST_NAME)
        named = path / Path(name).name
        if not named.is_dir():
            raise CheckpointError(f"{LATEST_NAME} names {name!r}, which is not a step folder here", path)
        return named, LATEST_NAME
    if (path / LATEST_NUMBER).is_file():
        text = _marker(path / LATEST_NUMBER)
        if not text.isdigit() or int(text) not in found:
            raise CheckpointError(f"{LATEST_NUMBER} says {text!r}, and there is no such step folder here", path)
        return found[int(text)], LATEST_NUMBER
    return found[max(found)], "the highest step"


def _marker(path: Path) -> str:
    """A latest marker's text, or a CheckpointError naming it when it cannot be read as text."""
    try:
        return path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read this latest marker: {getattr(e, 'strerror', None) or e}", path) from None


def pick_step(path: Path, step: str | int) -> tuple[Path, str]:
    """The step folder of ``step`` in the run root ``path`` (``latest`` as the run marks it),
    and a line saying which was picked and why."""
    found = steps(path) if path.is_dir() else {}
    if not found:
        kinds = ", ".join(STEP_DIRS)
        raise CheckpointError(f"{{step}} given, but there are no step folders here ({kinds})", path)
    if step == "latest":
        picked, why = _latest(path, found)
        return picked, f"--step latest: {picked.name} ({why})"
    try:
        picked = found[int(step)]
    except (KeyError, ValueError):
        raise CheckpointError(f"no step {step} here (steps: {', '.join(map(str, found))})", path) from None
    return picked, f"--step {step}: {picked.name}"
