"""Run a command as a child and take its wall time and peak RSS from the OS."""

from __future__ import annotations

import statistics
import subprocess
import tempfile
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
    with output discarded; return (wall seconds, peak RSS bytes of it and its children).

    The child is started through /usr/bin/time, a small process: a child spawned
    straight from this (large) Python shares its memory until exec, and the kernel
    counts that into the child's peak RSS.
    """
    time.sleep(settle)
    with tempfile.NamedTemporaryFile("r") as rss_file:
        t0 = time.perf_counter()
        proc = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", rss_file.name, *cmd], stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed with status {proc.returncode}")
        return wall, int(rss_file.read().split()[-1]) * 1024


def mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB"
