"""Run a command as a child and take its wall time and peak RSS from the OS."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field


@dataclass
class Runs:
    label: str
    walls: list[float] = field(default_factory=list)
    rss: list[int] = field(default_factory=list)  # bytes

    @property
    def wall(self) -> float:
        return statistics.median(self.walls)

    @property
    def peak(self) -> int:
        return max(self.rss)


def run_child(cmd: list[str], settle: float = 10.0) -> tuple[float, int]:
    """Sleep ``settle`` seconds (the host reclaims idle memory; let it), then run ``cmd``
    with output discarded; return (wall seconds, peak RSS bytes of it and its children)."""
    time.sleep(settle)
    devnull = os.open(os.devnull, os.O_WRONLY)
    actions = [(os.POSIX_SPAWN_DUP2, devnull, 1)]
    t0 = time.perf_counter()
    pid = os.posix_spawnp(cmd[0], cmd, os.environ, file_actions=actions)
    _, status, usage = os.wait4(pid, 0)
    wall = time.perf_counter() - t0
    os.close(devnull)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed with status {os.waitstatus_to_exitcode(status)}")
    return wall, usage.ru_maxrss * 1024


def mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB"
