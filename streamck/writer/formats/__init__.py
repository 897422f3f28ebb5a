"""Output formats, each one module implementing streamck.writer.formats.base.Format.

A format is looked up by name (``--format``) or by the output's file name (``-o x.gguf``);
its module is imported then, so a format's dependencies (gguf-py) cost nothing elsewhere.
"""

from __future__ import annotations

from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING

from streamck import registry
from streamck.errors import UsageError

if TYPE_CHECKING:
    from streamck.writer.formats.base import Format

FORMATS = {f.name: f for f in registry.FORMATS}  # the table is streamck.registry's


def get(name: str) -> Format:
    """The format called ``name``; a UsageError naming the known ones otherwise."""
    if name not in FORMATS:
        raise UsageError(f"{{format}} {name}: one of {', '.join(FORMATS)}")
    row = FORMATS[name]
    return getattr(import_module(row.module), row.cls)()


def named_by(path: Path | str) -> str | None:
    """The format a file output's name asks for, or None for a directory output."""
    name = Path(path).name
    return next((f.name for f in FORMATS.values() if name.endswith(f.suffixes)), None)


def choose(format: str | None, target: Path | str) -> tuple[Format, bool]:
    """The format to write to ``target`` and whether ``target`` is one file of it (its name
    asks for the format) rather than a directory; ``format`` must agree with the name."""
    named = None if str(target) == "-" else named_by(target)
    if format is not None and format not in FORMATS:
        get(format)
    if named is not None and format not in (None, named):
        raise UsageError(f"{{format}} {format} disagrees with the output's name {Path(target).name}")
    return get(named or format or "safetensors"), named is not None
