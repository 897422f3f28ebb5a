"""The one exception type users of the library need to catch."""

from __future__ import annotations

import os


def listing(items: list[str], limit: int = 8) -> str:
    """``a, b, c, … and N more``: a list for a one-line message, cut at ``limit`` items."""
    more = f", … and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


class StreamckError(Exception):
    """Bad input, a refused plan or a failed write; ``str()`` is one line a user can act on."""

    def __init__(self, message: str, path: str | os.PathLike | None = None):
        self.path = None if path is None else os.fspath(path)
        self.message = message
        super().__init__(f"{self.path}: {message}" if self.path else message)


class CheckpointError(StreamckError):
    """A source file or index that violates the format."""


class PlanError(StreamckError):
    """Rules that cannot be compiled against the source: collisions, bad patterns, refusals."""


class OutputError(StreamckError):
    """An output path that is refused, or a write that failed."""


class UsageError(StreamckError):
    """An argument the caller got wrong: a size, a dtype spelling, options that exclude each other."""


class DeviceError(StreamckError):
    """The device asked to cast on is missing, out of memory, or failed."""


class Info(str):
    """A notice that needs no action (non-tensor items skipped): ``rewrite -q`` leaves it out."""
