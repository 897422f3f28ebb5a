"""Per-tensor costs, no tensor data read: `ls --json` and `diff`, indexing many shards, and
DeepSeek-V3's layout from 1.6k to 140k tensors (time per tensor as the count grows)."""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from dsv3 import make_dsv3
from harness import HERE, PY, Runs, case, contend, cp_fsync, mib, streamck, table
from synth import make_many_shards


@case
def case_lsdiff(a: argparse.Namespace, tmp: Path) -> str:
    """`ls --json` and `diff` (headers only) on many shards and tensors, as a user runs them; torch stays out."""
    root = make_many_shards(tmp / "many", a.shards, a.tensors)
    (tmp / "golden.json").write_text(
        subprocess.run(streamck("ls", str(root), "--json"), capture_output=True, text=True, check=True).stdout
    )
    probe = (
        "import sys; from streamck.cli import main; main(sys.argv[1:]); "
        "sys.stderr.write('torch imported' if 'torch' in sys.modules else 'torch not imported')"
    )
    contenders = {
        "python -c pass (interpreter start)": lambda o: [PY, "-c", "pass"],
        "streamck ls --json": lambda o: [PY, "-c", probe, "ls", str(root), "--json"],
        "streamck diff golden.json CKPT": lambda o: [PY, "-c", probe, "diff", str(tmp / "golden.json"), str(root)],
    }
    runs = contend(contenders, tmp / "out", a.reps, a.settle, (root,))
    check = subprocess.run(
        [PY, "-c", probe, "diff", str(tmp / "golden.json"), str(root)], capture_output=True, text=True
    )
    return (
        f"{a.shards} shards × {a.tensors} tensors, each command a child process. After `diff`: {check.stderr}.\n\n"
        + table(runs, "python -c pass (interpreter start)", 0).replace("| 0.00 GB/s ", "| – ")
    )


def _json_headers(root: Path, shards: list[Path]) -> None:
    """The baseline: read + json.loads of every header and the index."""
    for p in shards:
        with open(p, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            json.loads(f.read(n))
    json.loads((root / "model.safetensors.index.json").read_bytes())


def _index_floor(root: Path) -> dict:
    """What any index must do, with no check at all: the index and the headers parsed by
    the fastest parser on the list, the shard list taken from the index, one reference
    per tensor, one dict of them, the collector kept off them as open_checkpoint does."""
    import orjson

    from streamck.source.header import TensorRef

    gc.disable()
    try:
        index = orjson.loads((root / "model.safetensors.index.json").read_bytes())
        tensors = {}
        for p in [root / name for name in sorted(set(index["weight_map"].values()))]:
            with open(p, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = orjson.loads(f.read(n))
            header.pop("__metadata__", None)
            for name, e in header.items():
                start, end = e["data_offsets"]
                ref = (name, e["dtype"], tuple(e["shape"]), p, 8 + n + start, 8 + n + end, None, None)
                tensors[name] = tuple.__new__(TensorRef, ref)
        gc.freeze()
        gc.unfreeze()
    finally:
        gc.enable()
    return tensors


def _safe_open_keys(shards: list[Path]) -> None:
    from safetensors import safe_open

    for p in shards:
        with safe_open(str(p), "np") as f:
            f.keys()


@case
def case_index(a: argparse.Namespace, tmp: Path) -> str:
    """Indexing 1,000 shards × 100 tensors vs reading and json-parsing the same headers."""
    sys.path.insert(0, str(HERE.parent))
    from streamck import open_checkpoint

    root = make_many_shards(tmp / "many", a.shards, a.tensors)
    shards = sorted(root.glob("*.safetensors"))
    timings: dict[str, list[float]] = {
        "read + json.loads of every header and the index": [],
        "safetensors safe_open + keys() of every shard": [],
        "read + orjson.loads + a reference per tensor, no check": [],
        "streamck open_checkpoint": [],
    }
    # the floor does all of the work but the checks
    assert len(_index_floor(root)) == len(open_checkpoint(root).tensors)
    contenders: tuple[Callable[[], object], ...] = (
        lambda: _json_headers(root, shards),
        lambda: _safe_open_keys(shards),
        lambda: _index_floor(root),
        lambda: open_checkpoint(root),
    )
    for _ in range(a.reps):
        for label, fn in zip(timings, contenders, strict=True):
            t0 = time.perf_counter()
            fn()
            timings[label].append(time.perf_counter() - t0)
    base = statistics.median(timings["read + json.loads of every header and the index"])
    rows = ["| contender | median | × baseline |", "|---|---|---|"]
    rows += [
        f"| {k} | {statistics.median(v) * 1000:.0f} ms | {statistics.median(v) / base:.2f} |"
        for k, v in timings.items()
    ]
    return (
        f"{a.shards} shards × {a.tensors} tensors = {a.shards * a.tensors} tensors, in-process, "
        f"{a.reps} interleaved reps (page cache warm).\n\n" + "\n".join(rows)
    )


START = "start-up (streamck --version)"
CP = "cp -r + sync"
FLOOR = "floor: Python strip"  # bench/copy_floor.py: the least a Python tool does per tensor
# The count case's commands on a checkpoint SRC (output OUT): each a child, as a user runs it.
COUNT_COMMANDS: dict[str, Callable[[Path, Path], list[str]]] = {
    "ls": lambda src, out: streamck("ls", str(src)),
    "rewrite": lambda src, out: streamck("rewrite", str(src), "-o", str(out)),
    "--strip-prefix": lambda src, out: streamck("rewrite", str(src), "-o", str(out), "--strip-prefix", "model."),
    "--dry-run": lambda src, out: streamck("rewrite", str(src), "-o", str(out), "--dry-run"),
    "hash": lambda src, out: streamck("hash", str(src)),
    CP: lambda src, out: cp_fsync(src)(out),
    FLOOR: lambda src, out: [PY, str(HERE / "copy_floor.py"), str(src), str(out), "model."],
}
REFERENCE = 9417  # issue #44's small end: 8 layers of DeepSeek-V3


def _count_runs(a: argparse.Namespace, tmp: Path, layers: int) -> tuple[int, dict[str, Runs]]:
    """Every COUNT_COMMANDS contender on DeepSeek-V3's layout with ``layers`` decoder layers."""
    src, count = make_dsv3(tmp / f"dsv3-{layers}", layers)
    contenders = {START: lambda out: streamck("--version")}
    contenders |= {label: (lambda out, make=make: make(src, out)) for label, make in COUNT_COMMANDS.items()}
    print(f"  {count} tensors ({layers} layers)", file=sys.stderr)
    runs = contend(contenders, tmp / "out", a.reps, a.settle, (src,))
    shutil.rmtree(src)
    return count, runs


def _count_tables(results: dict[int, dict[str, Runs]]) -> str:
    """Per command and tensor count: CPU µs per tensor (start-up's taken off: what a loaded
    machine changes least), wall seconds, peak RSS and KiB per tensor above start-up's; then the
    growth of the time per tensor from the count nearest REFERENCE to the largest, and each
    command against cp -r + sync there."""
    counts, labels = sorted(results), list(COUNT_COMMANDS)

    def off(n: int, label: str) -> Runs | None:
        """What a streamck command's figures are taken from: its start-up's; None for cp."""
        return None if label in (CP, FLOOR) else results[n][START]

    def per(n: int, label: str, cpu: bool = True) -> float:
        run, base = results[n][label], off(n, label)
        taken = (base.cpu if cpu else base.wall) if base else 0
        return ((run.cpu if cpu else run.wall) - taken) / n * 1e6

    def kib(n: int, label: str) -> float:
        base = off(n, label)
        return (results[n][label].peak - (base.peak if base else 0)) / n / 1024

    head, rule = "| tensors | start-up | " + " | ".join(labels) + " |", "|---" * (len(labels) + 2) + "|"
    ref, top = min(counts, key=lambda n: abs(n - REFERENCE)), counts[-1]
    rows = ["CPU (user + system) µs per tensor, start-up's taken off, then wall seconds (medians):\n", head, rule]
    for n in counts:
        cells = " | ".join(f"{per(n, k):.1f} µs, {results[n][k].wall:.2f} s" for k in labels)
        rows.append(f"| {n:,} | {results[n][START].cpu:.2f} s CPU | {cells} |")
    for what, cpu in (("CPU", True), ("wall", False)):
        ratios = " | ".join(
            f"{per(top, k, cpu) / per(ref, k, cpu):.2f}" if per(ref, k, cpu) > 0 else "–" for k in labels
        )
        rows.append(f"| {what} µs/tensor at {top:,} ÷ at {ref:,} | | {ratios} |")
    cp = results[top][CP].wall
    rows.append(
        f"| wall ÷ cp -r + sync at {top:,} | | " + " | ".join(f"{results[top][k].wall / cp:.1f}" for k in labels) + " |"
    )
    rows += ["", "Peak RSS, then KiB per tensor above start-up's:\n", head, rule]
    for n in counts:
        cells = " | ".join(f"{mib(results[n][k].peak)}, {kib(n, k):.2f}" for k in labels)
        rows.append(f"| {n:,} | {mib(results[n][START].peak)} | {cells} |")
    return "\n".join(rows)


@case
def case_count(a: argparse.Namespace, tmp: Path) -> str:
    """DeepSeek-V3's layout (FP8 + scales, 256 experts, MTP) at tiny shapes, 1.6k to 140k tensors:
    ls, rewrite, --strip-prefix, --dry-run, hash and cp -r + sync; time per tensor as the count grows."""
    results = {}
    for layers in (int(x) for x in a.layers.split(",")):
        count, runs = _count_runs(a, tmp, layers)
        results[count] = runs
    return (
        f"Decoder layers {a.layers} (+ the MTP layer; 61 is the real model), ~565 tensors a shard as the real "
        f"one's 163; {a.reps} interleaved reps, {a.settle:.0f} s settle, page cache warm.\n\n" + _count_tables(results)
    )
