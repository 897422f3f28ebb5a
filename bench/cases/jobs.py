"""--jobs 1/2/4 writing 8 output shards at once, copies and casts, into tmpfs and onto disk."""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from harness import case, contend, parse_size, streamck, table
from synth import make_checkpoint


def _rewrite_jobs(src: Path, jobs: int, extra: list[str]) -> Callable[[Path], list[str]]:
    # --jobs writes output shards at once: the output is split into 8 of them.
    shard = str(sum(p.stat().st_size for p in src.glob("*.safetensors")) // 8)
    return lambda o: streamck(
        "rewrite", str(src), "-o", str(o), "-q", "--jobs", str(jobs), "--max-shard-size", shard, *extra
    )


@case(size="2GiB")
def case_jobs(a: argparse.Namespace, tmp: Path) -> str:
    """--jobs 1/2/4 writing 8 output shards: copies and casts into tmpfs (CPU the limit) and onto disk."""
    size = parse_size(a.size)
    src = make_checkpoint(tmp / "src", size, size // 16, shard=size // 8)
    data = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    shm = Path(tempfile.mkdtemp(prefix="streamck-bench-jobs-", dir="/dev/shm"))
    parts = []
    try:
        for where, out in (("tmpfs", shm / "out"), ("disk", tmp / "out")):
            for what, extra in (("copy", []), ("cast", ["--dtype", "bf16"])):
                contenders = {f"--jobs {j}": _rewrite_jobs(src, j, extra) for j in (1, 2, 4)}
                runs = contend(contenders, out, a.reps, a.settle, (src,))
                parts.append(f"**{what} into {where}**\n\n" + table(runs, "--jobs 1", data))
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    return (
        f"Checkpoint: {data / 2**30:.2f} GiB F32 in {len(list(src.glob('*.safetensors')))} shards (page cache warm). "
        f"{a.reps} interleaved reps, {a.settle:.0f} s settle; the machine has {os.cpu_count()} cores.\n\n"
        + "\n\n".join(parts)
    )
