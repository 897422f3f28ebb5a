"""A write's progress on stderr: a tqdm bar on a terminal, a line at a steady pace for batch
jobs (a Slurm or Kubernetes job's stderr is a file: a bar there is one endless line, or
nothing for minutes), or nothing.

The writer calls a reporter with each write's byte count and ``tensor(name)`` as it starts
on a tensor; ``close()`` at the end, whatever happened.
"""

from __future__ import annotations

import sys
import threading
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

    def phase(self, verb: str) -> None:
        pass

    def close(self) -> None:
        pass


class Bar(Silent):
    """A tqdm byte counter on ``out``, labelled with what it counts (``writing``, then
    ``verifying``: each pass a bar of its own), left on the terminal when done."""

    def __init__(self, total: int, out: TextIO):
        self.total, self.out = total, out
        self.bar = self._bar("writing")

    def _bar(self, label: str):
        from tqdm import tqdm

        return tqdm(
            total=self.total, desc=label, unit="B", unit_scale=True, unit_divisor=1024, file=self.out,
            dynamic_ncols=True, leave=True,
        )  # fmt: skip

    def __call__(self, n: int) -> None:
        self.bar.update(n)

    def phase(self, verb: str) -> None:
        self.bar.close()
        self.bar = self._bar(verb)

    def close(self) -> None:
        self.bar.close()


class Log(Silent):
    """A line on ``out`` at most every ``every`` seconds of ``clock``: bytes done of the total,
    the average rate so far, the time left, and the tensor being written (the last one
    started, with several jobs) or verified.

    The time left is summed per kind of work (``kinds``: each tensor's name → its kind, such as
    ``copy``, ``cast`` or a transform's, and its bytes): each kind at its own rate so far, so
    a slow quantization after fast copies is not foretold at the copies' pace; a kind not
    begun yet goes at the overall rate. ``verify`` adds a re-read of every tensor (kind
    ``verify``) to the work. With ``beat``, a thread writes the line every ``every`` seconds
    even while no byte arrives (a long computation before a tensor's first bytes), so a
    batch log never falls silent; ``close()`` stops it."""

    def __init__(
        self,
        total: int,
        out: TextIO,
        clock: Callable[[], float] = time.monotonic,
        every: float | None = None,
        kinds: dict[str, tuple[str, int]] | None = None,
        verify: bool = False,
        beat: bool = False,
    ):
        # No line at the start: a run that fails within seconds says so in its one error line.
        self.total, self.out, self.clock = total * (1 + verify), out, clock
        self.every = LOG_EVERY if every is None else every
        self.start = self.last = self.since = clock()
        self.done = 0
        self.current: str | None = None
        self.verb, self.kind = "writing", None
        self.kinds = kinds or {}
        self.left: dict[str, int] = {}  # bytes still to do, by kind
        for kind, size in self.kinds.values():
            self.left[kind] = self.left.get(kind, 0) + size
        if verify:
            self.left["verify"] = total
        self.spent: dict[str, list[float]] = {}  # kind → [bytes done, seconds]
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True) if beat else None
        if self.thread is not None:
            self.thread.start()

    def __call__(self, n: int) -> None:
        with self.lock:
            self.done += n
            if self.kind is not None:
                self.left[self.kind] = self.left.get(self.kind, 0) - n
                self.spent.setdefault(self.kind, [0.0, 0.0])[0] += n
            self._maybe_line(self.clock())

    def tensor(self, name: str) -> None:
        with self.lock:
            now = self.clock()
            self._charge(now)
            self.current = name
            self.kind = "verify" if self.verb == "verifying" else self.kinds.get(name, ("other", 0))[0]

    def phase(self, verb: str) -> None:
        """What the tensors named from now on are undergoing (``verifying``)."""
        self.verb = verb

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()

    def _beat(self) -> None:
        while not self.stop.wait(max(self.every, 0.1)):  # LOG_EVERY 0 (tests): lines per update, no spinning
            with self.lock:
                self._maybe_line(self.clock())

    def _charge(self, now: float) -> None:
        """The time since the last tensor began, to that tensor's kind."""
        if self.kind is not None:
            self.spent.setdefault(self.kind, [0.0, 0.0])[1] += now - self.since
        self.since = now

    def _maybe_line(self, now: float) -> None:
        if now - self.last >= self.every:
            self.last = now
            self.out.write(self.line(now) + "\n")
            self.out.flush()

    def eta(self, now: float) -> float | None:
        """Seconds left: each kind's bytes left at that kind's rate so far (the current tensor's
        time counted), else at the overall rate; None before any byte is done."""
        elapsed = now - self.start
        overall = self.done / elapsed if elapsed > 0 else 0.0
        if overall <= 0:
            return None
        spent = {k: list(v) for k, v in self.spent.items()}
        if self.kind is not None:
            spent.setdefault(self.kind, [0.0, 0.0])[1] += now - self.since
        rest = max(self.total - self.done - sum(max(v, 0) for v in self.left.values()), 0)
        seconds = rest / overall
        for kind, left in self.left.items():
            done, took = spent.get(kind, (0.0, 0.0))
            seconds += max(left, 0) / (done / took if done > 0 and took > 0 else overall)
        return seconds

    def line(self, now: float) -> str:
        """The progress line at time ``now``."""
        elapsed = now - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = self.eta(now)
        left = f"ETA {duration(eta)}" if eta is not None else "ETA unknown"
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        at = f", {self.verb} {self.current}" if self.current is not None else ""
        return (
            f"streamck: progress: {human(self.done)} of {human(self.total)}{share}, "
            f"{human(rate)}/s, {left}, {duration(elapsed)} elapsed{at}"
        )


def reporter(
    total: int,
    mode: bool | str | Silent | None,
    out: TextIO | None = None,
    kinds: dict[str, tuple[str, int]] | None = None,
    verify: bool = False,
) -> Silent:
    """The reporter for ``mode``: ``auto`` (a bar on a terminal, else log lines), ``bar``,
    ``log`` or ``none``; True is ``bar`` and False or None ``none`` (the library's older
    spelling); a reporter is itself. Raises UsageError for another mode. Log lines know the
    ``kinds`` of work and whether a ``verify`` pass follows (see Log), and keep coming while
    no byte arrives."""
    if isinstance(mode, Silent):
        return mode
    out = sys.stderr if out is None else out
    if mode is True or mode is False or mode is None:
        mode = "bar" if mode else "none"
    if mode not in MODES:
        raise UsageError(f"{{progress}} {mode}: one of {', '.join(MODES)}")
    if mode == "auto":
        mode = "bar" if out.isatty() else "log"
    if mode == "log":
        return Log(total, out, kinds=kinds, verify=verify, beat=True)
    return Bar(total, out) if mode == "bar" else Silent()
