"""What the ``streamck`` command prints on stdout: tensor tables, a plan, a run's report."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from streamck.units import human

if TYPE_CHECKING:
    from streamck.plan import Plan
    from streamck.source import Checkpoint


def shape_str(shape) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


class _Shapes(dict):
    """Shapes rendered once each, for a table: a checkpoint of 92k tensors has a few dozen
    shapes, and rendering one per row was an eighth of a --dry-run's listing (#44)."""

    def __missing__(self, shape: tuple[int, ...]) -> str:
        self[shape] = text = shape_str(shape)
        return text


def table(rows: list[tuple[str, ...]], out=None) -> None:
    """``rows`` in columns two spaces apart, each as wide as its widest cell, lines unpadded at
    the end. One format string for every row: a generator per row and cell was a third of
    ``ls`` at 92k tensors (#44). To ``out``, else the sys.stdout of the call (not of the import)."""
    out = sys.stdout if out is None else out
    widths = [max(map(len, column)) for column in zip(*rows, strict=True)]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    out.writelines(line.format(*r).rstrip() + "\n" for r in rows)


def _files(t, root: Path, relative: dict[Path, str]) -> str:
    """The file ``t`` lies in (and how many more), by its path under ``root`` (``relative``: known ones)."""
    if not t.paths:  # a tensor of no elements read as tiles lies in no file
        return "-"
    first = relative.get(t.path) or os.path.relpath(t.path, root)
    return first if len(t.paths) == 1 else f"{first} (+{len(t.paths) - 1} more)"


def print_checkpoint(ckpt: Checkpoint, hint: str | None) -> None:
    """``ls``'s table of every tensor, its totals, and the plan a trainer's checkpoint needs."""
    # One relpath per file, not per tensor: half of ``ls``'s time at 92k tensors (#44).
    relative = {path: os.path.relpath(path, ckpt.root) for path in ckpt.files}
    rows = [("NAME", "DTYPE", "SHAPE", "BYTES", "FILE")]
    shapes = _Shapes()
    rows += [
        (t.name, t.dtype, shapes[t.shape], str(t.nbytes), _files(t, ckpt.root, relative))
        for t in sorted(ckpt.tensors.values(), key=lambda t: t.name)
    ]
    table(rows)
    from streamck.plan.moe.blocks import layout_line

    moe = layout_line({t.name: t.shape for t in ckpt.tensors.values()})
    if moe:
        print(moe)
    print(
        f"{len(ckpt.tensors)} tensors in {len(ckpt.files)} file(s) "
        f"{'under ' + str(ckpt.root) if ckpt.path.is_dir() else 'in ' + str(ckpt.path)}, {human(ckpt.total_size)} "
        f"({ckpt.total_size} bytes)"
    )
    if hint:
        print(hint)


def print_plan(plan: Plan) -> None:
    """A dry run's listing: the plan's summary, each output tensor beside its source, totals."""
    for line in plan.summary:
        print(line)
    rows = [("SOURCE", "OUTPUT", "DTYPE", "SHAPE", "BYTES")]
    shapes = _Shapes()
    for t in plan.tensors:
        src = t.transform.origin(t.source) if t.transform is not None else t.source
        dtype = f"{src.dtype}->{t.dtype}" if t.dtype != src.dtype else t.dtype
        dtype += f" {t.transform.label}" if t.transform is not None and t.transform.label else ""
        rows.append((src.name, t.name, dtype, shapes[t.shape], str(t.nbytes)))
    table(rows)
    src = plan.source
    dropped = len(src.tensors) - len(plan.tensors) if src else 0
    counts = f"{dropped} dropped" if dropped >= 0 else f"from {len(src.tensors)} source tensors"  # experts split
    print(f"{len(plan.tensors)} tensors ({counts}), {human(plan.total_size)} ({plan.total_size} bytes)")
