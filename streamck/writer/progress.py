"""A write's progress on stderr: a tqdm bar on a terminal, a line at a steady pace for batch
jobs (a Slurm or Kubernetes job's stderr is a file: a bar there is one endless line, or
nothing for minutes), or nothing.

The writer calls a reporter with each write's byte count and ``tensor(name)`` as it starts
on a tensor; ``close()`` at the end, whatever happened.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from streamck.errors import UsageError
from streamck.units import duration, human

MODES = ("auto", "bar", "log", "none")
LOG_EVERY = 10.0  # seconds between two log lines


class Silent:
    """No progress shown (``none``, and the base of the others)."""

    def __call__(self, n: int) -> None:
        pass

    def tensor(self, name: str) -> None:
        pass

    def close(self) -> None:
        pass


class Bar(Silent):
    """A tqdm byte counter on ``out``, gone when closed."""

    def __init__(self, total: int, out: TextIO):
        from tqdm import tqdm

        self.bar = tqdm(
            total=total, unit="B", unit_scale=True, unit_divisor=1024, file=out, dynamic_ncols=True, leave=False
        )

    def __call__(self, n: int) -> None:
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


class Log(Silent):
    """A line on ``out`` at most every ``every`` seconds of ``clock``, as bytes arrive: bytes
    done of the total, the average rate so far, the time left at that rate, and the tensor
    being written (the last one started, with several jobs)."""

    def __init__(
        self, total: int, out: TextIO, clock: Callable[[], float] = time.monotonic, every: float | None = None
    ):
        # No line at the start: a run that fails within seconds says so in its one error line.
        self.total, self.out, self.clock = total, out, clock
        self.every = LOG_EVERY if every is None else every
        self.start = self.last = clock()
        self.done = 0
        self.current: str | None = None

    def __call__(self, n: int) -> None:
        self.done += n
        now = self.clock()
        if now - self.last >= self.every:
            self.last = now
            self.out.write(self.line(now) + "\n")
            self.out.flush()

    def tensor(self, name: str) -> None:
        self.current = name

    def line(self, now: float) -> str:
        """The progress line at time ``now``."""
        elapsed = now - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        left = f"ETA {duration((self.total - self.done) / rate)}" if rate > 0 else "ETA unknown"
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        at = f", writing {self.current}" if self.current is not None else ""
        return (
            f"streamck: progress: {human(self.done)} of {human(self.total)}{share}, "
            f"{human(rate)}/s, {left}, {duration(elapsed)} elapsed{at}"
        )


def reporter(total: int, mode: bool | str | Silent | None, out: TextIO | None = None) -> Silent:
    """The reporter for ``mode``: ``auto`` (a bar on a terminal, else log lines), ``bar``,
    ``log`` or ``none``; True is ``bar`` and False or None ``none`` (the library's older
    spelling); a reporter is itself. Raises UsageError for another mode."""
    if isinstance(mode, Silent):
        return mode
    out = sys.stderr if out is None else out
    if mode is True or mode is False or mode is None:
        mode = "bar" if mode else "none"
    if mode not in MODES:
        raise UsageError(f"--progress {mode}: one of {', '.join(MODES)}")
    if mode == "auto":
        mode = "bar" if out.isatty() else "log"
    return Bar(total, out) if mode == "bar" else Log(total, out) if mode == "log" else Silent()
