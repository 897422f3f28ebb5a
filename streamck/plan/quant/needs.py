"""What quantizing and dequantizing need installed, checked when the plan is made: torch computes
their bytes (as llm-compressor and transformers do), and a missing torch found only by the writer
would come out as a traceback midway, where ``--dry-run`` would never have said it."""

from __future__ import annotations

from importlib.util import find_spec

from streamck.errors import TORCH_HINT, UsageError


def require_torch(what: str) -> None:
    """UsageError (one line, exit 2) naming what to install when torch cannot be imported.
    ``find_spec`` does not import it: a dry run stays as quick as before."""
    try:
        found = find_spec("torch") is not None
    except (ImportError, ValueError):  # a half-removed install: a module without its spec
        found = False
    if not found:
        raise UsageError(f"{what} computes with torch, which is not installed: {TORCH_HINT}")
