"""Output formats, each one module implementing streamck.writer.formats.base.Format.

A format is looked up by name (``--format``) or by the output's file name (``-o x.gguf``);
its module is imported then, so a format's dependencies (gguf-py) cost nothing elsewhere.
"""

from __future__ import annotations

from dataclasses import replace
from importlib import import_module
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING

from streamck import registry
from streamck.errors import UsageError

if TYPE_CHECKING:
    from streamck.plan.options import PlanOptions
    from streamck.writer.formats.base import Format
    from streamck.writer.options import WriteOptions

FORMATS = {f.name: f for f in registry.FORMATS}  # the table is streamck.registry's


def get(name: str) -> Format:
    """The format called ``name``; a UsageError naming the known ones otherwise."""
    if name not in FORMATS:
        raise UsageError(f"{{format}} {name}: one of {', '.join(FORMATS)}")
    row = FORMATS[name]
    missing = [package for package in row.needs if not _installed(package)]
    if missing:  # said before anything is read, as one line (not an ImportError's traceback)
        verb = "is" if len(missing) == 1 else "are"
        raise UsageError(f"{name} output needs {' and '.join(missing)}, which {verb} not installed: {row.install}")
    return getattr(import_module(row.module), row.cls)()


def _installed(package: str) -> bool:
    try:
        return find_spec(package) is not None
    except (ImportError, ValueError):  # None in sys.modules, or a half-removed install
        return False


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


def route_types(fmt: Format, plan: PlanOptions, write: WriteOptions) -> tuple[PlanOptions, WriteOptions]:
    """The options as ``fmt`` takes them: a format that chooses its tensors' types itself (GGUF,
    as ``convert_hf_to_gguf.py --outtype``) takes ``dtype`` and its own ``quantize`` schemes from
    the plan's options as its ``outtype``, so that the plan casts nothing it would cast again."""
    scheme = (plan.quantize or "").upper()
    for name in registry.OWN_OPTIONS:
        if getattr(write, name) is not None and name not in FORMATS[fmt.name].takes:
            owners = " and ".join(f"{{format}} {f.name}" for f in FORMATS.values() if name in f.takes)
            raise UsageError(f"{{{name}}} applies to {owners} output, not to {fmt.name}")
    if scheme and scheme not in fmt.quantizes and fmt.own_schemes_only:
        raise UsageError(f"{{quantize}} {plan.quantize}: {fmt.name} output writes {', '.join(fmt.quantizes)}")
    if scheme.startswith("MLX_") and scheme not in fmt.quantizes:
        raise UsageError(f"{{quantize}} {plan.quantize} is an MLX scheme: add {{format}} mlx")
    if scheme in fmt.quantizes:
        return replace(plan, quantize=None), replace(write, outtype=scheme.lower())
    if fmt.owns_types and plan.dtype is not None and plan.quantize is None:
        return replace(plan, dtype=None), replace(write, outtype=plan.dtype.lower())
    return plan, write
