"""A prefix strip on a reflink XFS loop image: streamck --keep-shards (clones) vs cp --reflink=never/always."""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from harness import Runs, case, parse_size, recache, run_child, streamck, table
from loopfs import reflink_mount, used
from synth import make_checkpoint


def _mib2(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def _clone_size(a: argparse.Namespace, tmp: Path, size: int) -> str:
    """One size of the clone case: the checkpoint and every contender on one XFS image."""
    embed = min(parse_size(a.embed), size // 4)
    with reflink_mount(tmp, 2 * size + (1 << 30)) as mnt:
        src, out = make_checkpoint(mnt / "src", size, embed), mnt / "out"
        data = sum(p.stat().st_size for p in src.glob("*.safetensors"))
        shards = len(list(src.glob("*.safetensors")))
        cp = 'cp -r --reflink={} "{}" "{}" && sync "{}"/*'
        contenders = {
            "cp -r --reflink=never + sync": lambda o: ["sh", "-c", cp.format("never", src, o, o)],
            "cp -r --reflink=always + sync": lambda o: ["sh", "-c", cp.format("always", src, o, o)],
            "streamck --keep-shards": lambda o: streamck(
                "rewrite", str(src), "-o", str(o), "--strip-prefix", "model.", "--keep-shards", "-q"
            ),
        }
        recache(src)
        runs = {label: Runs(label) for label in contenders}
        new: dict[str, list[int]] = {label: [] for label in contenders}
        for rep in range(a.reps):
            for label, make in contenders.items():
                time.sleep(a.settle)
                before = used(mnt)  # settled: the last output's blocks are free again
                wall, rss = run_child(make(out), 0)
                new[label].append(used(mnt) - before)
                runs[label].walls.append(wall)
                runs[label].rss.append(rss)
                line = f"  rep {rep + 1}/{a.reps} {label:<30} {wall:6.2f} s {_mib2(new[label][-1])} new"
                print(line, file=sys.stderr)
                shutil.rmtree(out)
    rows = ["| contender | new blocks (median) | runs |", "|---|---|---|"]
    rows += [f"| {k} | {_mib2(statistics.median(v))} | {', '.join(map(_mib2, v))} |" for k, v in new.items()]
    return (
        f"### {data / 2**30:.2f} GiB in {shards} shards\n\n"
        + table(runs, "cp -r --reflink=never + sync", data)
        + "\n\nNew blocks on the filesystem (statvfs before and after each run, settled, nothing removed between):\n\n"
        + "\n".join(rows)
    )


@case(size="2GiB,16GiB")
def case_clone(a: argparse.Namespace, tmp: Path) -> str:
    """Prefix strip on a reflink XFS loop image: streamck --keep-shards vs cp --reflink=never/always."""
    sizes = [parse_size(s) for s in a.size.split(",")]
    parts = []
    for i, size in enumerate(sizes):
        (tmp / str(i)).mkdir()
        parts.append(_clone_size(a, tmp / str(i), size))
    return (
        f"XFS (`mkfs.xfs -m reflink=1`) on a loop device over a sparse image; kernel {os.uname().release}. "
        f"F32 checkpoints, largest tensor {a.embed}, `--strip-prefix model.`; walls include interpreter start. "
        f"{a.reps} interleaved reps, {a.settle:.0f} s settle.\n\n" + "\n\n".join(parts)
    )
