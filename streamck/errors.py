"""The one exception type users of the library need to catch."""

from __future__ import annotations

import os


class StreamckError(Exception):
    """Bad input, a refused plan or a failed write; ``str()`` is one line a user can act on."""

    def __init__(self, message: str, path: str | os.PathLike | None = None):
        self.path = None if path is None else os.fspath(path)
        super().__init__(f"{self.path}: {message}" if self.path else message)


class CheckpointError(StreamckError):
    """A source file or index that violates the format."""


class PlanError(StreamckError):
    """Rules that cannot be compiled against the source: collisions, bad patterns, refusals."""


class OutputError(StreamckError):
    """An output path that is refused, or a write that failed."""
