"""Contenders as child processes: wall time and peak RSS from the OS, interleaved runs, tables."""

from __future__ import annotations

import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Runs:
    label: str
    walls: list[float] = field(default_factory=list)
    rss: list[int] = field(default_factory=list)  # bytes
    trace: list[tuple[float, int]] = field(default_factory=list)  # (seconds, RSS bytes) of the last run
    cpus: list[float] = field(default_factory=list)  # user + system seconds of each run, its children's too

    @property
    def wall(self) -> float:
        return statistics.median(self.walls)

    @property
    def cpu(self) -> float:
        """Median CPU seconds: what a loaded machine changes least (wall time waits for the CPU)."""
        return statistics.median(self.cpus)

    @property
    def peak(self) -> int:
        return max(self.rss)


# Runs argv[2:], writes its peak RSS in KiB to argv[1], exits with its status.
_RUSAGE = (
    "import resource, subprocess, sys; rc = subprocess.call(sys.argv[2:]); "
    "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)); sys.exit(rc)"
)


def _peak_rss(out: str) -> list[str]:
    """A small wrapper process that writes its child's peak RSS (KiB) into the file ``out``."""
    if shutil.which("/usr/bin/time"):
        return ["/usr/bin/time", "-f", "%M", "-o", out]
    return [sys.executable, "-c", _RUSAGE, out]  # machines without GNU time (the GPU image)


def _tree_rss(pid: int) -> int:
    """RSS in bytes of ``pid``'s descendants (the wrapper itself excluded), from /proc."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    stack.extend(int(c) for c in f.read().split())
            if p != pid:
                with open(f"/proc/{p}/status") as f:
                    total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024
        except (OSError, StopIteration, ValueError):
            continue  # gone between listing and reading
    return total


def run_child(cmd: list[str], settle: float = 10.0, trace: list | None = None) -> tuple[float, int]:
    """Sleep ``settle`` seconds (the host reclaims idle memory; let it), then run ``cmd``
    with output discarded; return (wall seconds, peak RSS bytes of it and its children).

    The child is started through /usr/bin/time (or, where that is missing, a small
    Python that reads getrusage of its one child), a small process: a child spawned
    straight from this (large) Python shares its memory until exec, and the kernel
    counts that into the child's peak RSS. With ``trace``, (seconds, RSS of the process
    tree) samples from /proc every ~50 ms are appended to it, for the memory plots.
    """
    time.sleep(settle)
    with tempfile.NamedTemporaryFile("r") as rss_file:
        t0 = time.perf_counter()
        proc = subprocess.Popen([*_peak_rss(rss_file.name), *cmd], stdout=subprocess.DEVNULL)
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.05):
                trace.append((time.perf_counter() - t0, _tree_rss(proc.pid)))

        sampler = threading.Thread(target=sample, daemon=True) if trace is not None else None
        if sampler:
            sampler.start()
        returncode = proc.wait()
        wall = time.perf_counter() - t0
        done.set()
        if sampler:
            sampler.join()
        if returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed with status {returncode}")
        return wall, int(rss_file.read().split()[-1]) * 1024


def mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB"


PY = sys.executable


def precompile(tree: Path) -> None:
    """Byte-compile the streamck package under ``tree``, as ``pip install`` does for an
    installed one. Where PYTHONDONTWRITEBYTECODE is set (this machine sets it), a source
    tree is otherwise compiled again by every run: ~25 ms of a 0.6 s consolidation, paid by
    no installed tool it is compared with."""
    subprocess.run([PY, "-m", "compileall", "-q", str(tree / "streamck")], check=True)


def streamck(*args: str) -> list[str]:
    return [PY, "-m", "streamck", *args]


def cp_fsync(src: Path) -> Callable[[Path], list[str]]:
    """The yardstick: ``cp`` (``-r`` for a directory) of ``src``, then fsync of what it wrote."""
    if src.is_dir():
        return lambda out: ["sh", "-c", f'cp -r "{src}" "{out}" && sync "{out}"/*']
    return lambda out: ["sh", "-c", f'cp "{src}" "{out}" && sync "{out}"']


def recache(*paths: Path) -> None:
    """Leave every file under ``paths`` in the page cache as a read from disk leaves it.

    The page cache a producer's own writes leave differs: on this machine's kernel,
    ``cp`` copied a shard torch's DCP writer had just written at 0.4 GB/s, the same
    shard dropped and read back at 0.9 GB/s (readahead builds larger folios). Every
    contender starts from the same state: flushed, dropped, read once."""
    files = [f for p in paths for f in ([p] if p.is_file() else sorted(q for q in p.rglob("*") if q.is_file()))]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)  # only clean pages can be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            while os.read(fd, 1 << 20):
                pass
        finally:
            os.close(fd)


def contend(
    contenders: dict[str, Callable[[Path], list[str]]], out: Path, reps: int, settle: float, sources: tuple[Path, ...]
) -> dict[str, Runs]:
    """Run every contender ``reps`` times, interleaved; each writes to ``out``, removed after.
    ``sources`` (what they read) are first put in the page cache as a read from disk would (recache)."""
    recache(*sources)
    runs = {label: Runs(label) for label in contenders}
    for rep in range(reps):
        for label, make in contenders.items():
            trace: list[tuple[float, int]] = []
            before = _children_cpu()
            wall, rss = run_child(make(out), settle, trace)
            runs[label].cpus.append(_children_cpu() - before)
            runs[label].walls.append(wall)
            runs[label].rss.append(rss)
            runs[label].trace = trace
            print(f"  rep {rep + 1}/{reps} {label:<28} {wall:7.2f} s {mib(rss):>9}", file=sys.stderr)
            if out.is_dir():
                shutil.rmtree(out)
            elif out.exists():
                out.unlink()
    return runs


def _children_cpu() -> float:
    """User + system seconds of every child (and theirs) this process has waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def table(runs: dict[str, Runs], base: str, data_bytes: int | None = None) -> str:
    """Markdown: median wall, ratio to ``base``, throughput of ``data_bytes``, peak RSS, every run."""
    b = runs[base].wall
    rows = [f"| contender | wall (median) | × {base} | throughput | peak RSS | runs |", "|---|---|---|---|---|---|"]
    for r in runs.values():
        rate = f"{data_bytes / r.wall / 1e9:.2f} GB/s" if data_bytes else "–"
        walls = ", ".join(f"{w:.2f}" for w in r.walls)
        rows.append(f"| {r.label} | {r.wall:.2f} s | {r.wall / b:.2f} | {rate} | {mib(r.peak)} | {walls} |")
    return "\n".join(rows)


def plot(runs: dict[str, Runs], path: Path, title: str) -> str:
    """Draw every contender's RSS over time (its last run) into ``path`` (PNG); returns a
    line for the report. matplotlib is a bench-only dependency: without it, no plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "(no memory plot: `pip install matplotlib` to draw one)"
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=110)
    for r in runs.values():
        if r.trace:
            ax.plot([t for t, _ in r.trace], [m / 2**20 for _, m in r.trace], label=r.label, linewidth=1.6)
    ax.set_xlabel("seconds")
    ax.set_ylabel("RSS (MiB)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return f"![RSS over time]({path.relative_to(path.parents[1])})"
