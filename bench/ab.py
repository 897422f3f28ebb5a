"""One streamck command, old code against new, interleaved on the same files.

    python bench/ab.py 7e4376f rewrite SRC --dtype bf16 --reps 4

Ratios against ``cp`` move between runs on a VM (bench/RESULTS.md, "What we saw"); the
fair test of a code change is both versions run alternately, each after the same settle,
on the same source. ``REV`` is checked out into a temporary git worktree; the working
tree is "new". Each run writes to a fresh output that is removed afterwards; ``cp -r`` +
``sync`` of the source runs in the same rotation as a yardstick.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from measure import PY, cp_fsync, precompile, recache, run_child  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("rev", help="the old code: a git revision")
    p.add_argument("command", help="streamck subcommand, e.g. rewrite")
    p.add_argument("source", type=Path)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--settle", type=float, default=10.0)
    a, extra = p.parse_known_args()
    repo = HERE.parent
    tmp = Path(tempfile.mkdtemp(prefix="streamck-ab-", dir=os.environ.get("BENCH_DIR")))
    old = tmp / "old"
    subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", "-q", str(old), a.rev], check=True)
    try:
        trees = {f"old ({a.rev})": old, "new (working tree)": repo}
        walls: dict[str, list[float]] = {label: [] for label in [*trees, "cp -r + sync"]}
        out = tmp / "out"
        for tree in trees.values():
            precompile(tree)
        recache(a.source)
        copy = cp_fsync(a.source)
        for rep in range(a.reps):
            for label, tree in trees.items():
                # -P: the working directory must not put the new code ahead of PYTHONPATH
                cmd = [
                    "env",
                    f"PYTHONPATH={tree}",
                    PY,
                    "-P",
                    "-m",
                    "streamck",
                    a.command,
                    str(a.source),
                    "-o",
                    str(out),
                ]
                wall, _ = run_child([*cmd, "-q", *extra], a.settle)
                walls[label].append(wall)
                shutil.rmtree(out) if out.is_dir() else out.unlink()
            wall, _ = run_child(copy(out), a.settle)
            walls["cp -r + sync"].append(wall)
            shutil.rmtree(out) if out.is_dir() else out.unlink()
            print(
                f"rep {rep + 1}/{a.reps}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in walls.items()), file=sys.stderr
            )
        for label, v in walls.items():
            print(f"{label}: median {statistics.median(v):.2f} s ({', '.join(f'{x:.2f}' for x in v)})")
    finally:
        subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(old)], check=False)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
