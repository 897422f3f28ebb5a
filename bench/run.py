"""streamck benchmarks: each contender a child process, wall time and peak RSS from the OS.

    python bench/run.py                 # every case at its default size (a few minutes)
    python bench/run.py rewrite --size 8GiB --reps 5
    python bench/run.py index

Contenders run interleaved (A B C A B C) after a settle pause; the table gives
medians and ratios against the baseline of the same run, and is written into
bench/RESULTS.md between that case's markers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from measure import Runs, mib, run_child  # noqa: E402
from synth import make_checkpoint, parse_size  # noqa: E402

PY = sys.executable
CASES: dict[str, Callable[[argparse.Namespace, Path], str]] = {}


def case(fn):
    CASES[fn.__name__.removeprefix("case_")] = fn
    return fn


def contend(contenders: dict[str, Callable[[Path], list[str]]], out: Path, reps: int, settle: float) -> dict[str, Runs]:
    """Run every contender ``reps`` times, interleaved; each writes to ``out``, removed after."""
    runs = {label: Runs(label) for label in contenders}
    for rep in range(reps):
        for label, make in contenders.items():
            wall, rss = run_child(make(out), settle)
            runs[label].walls.append(wall)
            runs[label].rss.append(rss)
            print(f"  rep {rep + 1}/{reps} {label:<28} {wall:7.2f} s {mib(rss):>9}", file=sys.stderr)
            shutil.rmtree(out, ignore_errors=True)
            out.unlink(missing_ok=True) if out.is_file() else None
    return runs


def table(runs: dict[str, Runs], base: str, data_bytes: int) -> str:
    b = runs[base].wall
    rows = [
        "| contender | wall (median) | × " + base + " | throughput | peak RSS | runs |",
        "|---|---|---|---|---|---|",
    ]
    for r in runs.values():
        rows.append(
            f"| {r.label} | {r.wall:.2f} s | {r.wall / b:.2f} | {data_bytes / r.wall / 1e9:.2f} GB/s "
            f"| {mib(r.peak)} | {', '.join(f'{w:.2f}' for w in r.walls)} |"
        )
    return "\n".join(rows)


def streamck(*args: str) -> list[str]:
    return [PY, "-m", "streamck", *args, "-q"]


def cp_fsync(src: Path) -> Callable[[Path], list[str]]:
    return lambda out: ["sh", "-c", f'cp -r "{src}" "{out}" && sync "{out}"/*']


@case
def case_rewrite(a: argparse.Namespace, tmp: Path) -> str:
    """Unchanged-bytes rewrite (--strip-prefix model.) vs cp -r and the load/save route."""
    size, embed = parse_size(a.size), parse_size(a.embed)
    big = make_checkpoint(tmp / "big", size, embed)
    small = make_checkpoint(tmp / "small", size // 4, embed // 4)
    data = sum(p.stat().st_size for p in big.glob("*.safetensors"))
    out = tmp / "out"
    contenders = {
        "cp -r + sync": cp_fsync(big),
        "safetensors load/save": lambda o: [PY, str(HERE / "naive.py"), str(big), str(o)],
        "streamck rewrite": lambda o: streamck("rewrite", str(big), "-o", str(o), "--strip-prefix", "model."),
    }
    runs = contend(contenders, out, a.reps, a.settle)
    _, s_rss = run_child(streamck("rewrite", str(small), "-o", str(out), "--strip-prefix", "model."), a.settle)
    shutil.rmtree(out)
    return (
        f"Checkpoint: {data / 2**30:.2f} GiB in {len(list(big.glob('*.safetensors')))} shards, largest tensor "
        f"{embed / 2**30:.2f} GiB (F32). {a.reps} interleaved reps, {a.settle:.0f} s settle.\n\n"
        + table(runs, "cp -r + sync", data)
        + f"\n\nstreamck peak RSS as the checkpoint grows: {mib(s_rss)} at "
        f"{size // 4 / 2**30:.2f} GiB (largest tensor {embed // 4 / 2**30:.2f} GiB) vs "
        f"{mib(runs['streamck rewrite'].peak)} at {size / 2**30:.2f} GiB."
    )


@case
def case_cast(a: argparse.Namespace, tmp: Path) -> str:
    """F32 -> BF16 cast: cp of the source, in-memory torch copy_, load/.to/save, streamck --dtype bf16."""
    size, embed = parse_size(a.size), parse_size(a.embed)
    big = make_checkpoint(tmp / "big", size, embed)
    small = make_checkpoint(tmp / "small", size // 4, embed // 4)
    data = sum(p.stat().st_size for p in big.glob("*.safetensors"))
    out = tmp / "out"

    def rw(src):
        return lambda o: streamck("rewrite", str(src), "-o", str(o), "--strip-prefix", "model.", "--dtype", "bf16")

    contenders = {
        "cp -r + sync (source)": cp_fsync(big),
        "load_file/.to(bf16)/save_file": lambda o: [PY, str(HERE / "naive.py"), str(big), str(o), "--dtype", "bf16"],
        "streamck --dtype bf16": rw(big),
    }
    runs = contend(contenders, out, a.reps, a.settle)
    inmem = []
    for _ in range(a.reps):
        time.sleep(a.settle)
        proc = subprocess.run([PY, str(HERE / "inmem_cast.py"), str(data)], capture_output=True, text=True, check=True)
        inmem.append(float(proc.stdout))
    _, s_rss = run_child(rw(small)(out), a.settle)
    shutil.rmtree(out)
    base = runs["cp -r + sync (source)"].wall
    return (
        f"Checkpoint: {data / 2**30:.2f} GiB F32 in {len(list(big.glob('*.safetensors')))} shards, largest "
        f"tensor {embed / 2**30:.2f} GiB; output BF16. {a.reps} interleaved reps, {a.settle:.0f} s settle.\n\n"
        + table(runs, "cp -r + sync (source)", data)
        + f"\n\nIn-memory torch `copy_` F32→BF16 of the same {data / 2**30:.2f} GiB (compute ceiling, no I/O): "
        f"median {statistics.median(inmem):.2f} s = {statistics.median(inmem) / base:.2f} × cp, "
        f"{data / statistics.median(inmem) / 1e9:.2f} GB/s.\n\n"
        f"streamck peak RSS: {mib(s_rss)} at {size // 4 / 2**30:.2f} GiB (largest tensor "
        f"{embed // 4 / 2**30:.2f} GiB) vs {mib(runs['streamck --dtype bf16'].peak)} at {size / 2**30:.2f} GiB."
    )


def make_bin(path: Path, size: int, embed: int) -> Path:
    """A torch.save zip checkpoint shaped like synth's: one large embedding, then layers."""
    import torch
    from synth import llama_tensors

    state = {}
    for name, shape in llama_tensors(size, embed, "F32"):
        state[name] = torch.empty(shape).normal_()
    torch.save(state, path)
    os.sync()
    return path


@case
def case_bin(a: argparse.Namespace, tmp: Path) -> str:
    """PyTorch .bin -> model.safetensors: cp of the .bin, torch.load + save_file, streamck rewrite."""
    size, embed = parse_size(a.size), parse_size(a.embed)
    src = make_bin(tmp / "pytorch_model.bin", size, embed)
    data = src.stat().st_size
    out = tmp / "out.safetensors"
    contenders = {
        "cp + sync": lambda o: ["sh", "-c", f'cp "{src}" "{o}" && sync "{o}"'],
        "torch.load + save_file": lambda o: [PY, str(HERE / "naive_bin.py"), str(src), str(o)],
        "streamck rewrite": lambda o: streamck("rewrite", str(src), "-o", str(o)),
    }
    runs = contend(contenders, out, a.reps, a.settle)
    return (
        f"Source: one {data / 2**30:.2f} GiB `torch.save` zip (F32, largest tensor {embed / 2**30:.2f} GiB). "
        f"{a.reps} interleaved reps, {a.settle:.0f} s settle.\n\n" + table(runs, "cp + sync", data)
    )


@case
def case_index(a: argparse.Namespace, tmp: Path) -> str:
    """Indexing 1,000 shards × 100 tensors vs reading and json-parsing the same headers."""
    sys.path.insert(0, str(HERE.parent))
    from streamck import open_checkpoint

    root = tmp / "many"
    root.mkdir()
    weight_map = {}
    for s in range(a.shards):
        name = f"model-{s + 1:05d}-of-{a.shards:05d}.safetensors"
        header = {"__metadata__": {"format": "pt"}}
        for t in range(a.tensors):
            key = f"model.layers.{s}.block.{t}.weight"
            header[key] = {"dtype": "BF16", "shape": [2, 2], "data_offsets": [8 * t, 8 * t + 8]}
            weight_map[key] = name
        raw = json.dumps(header, separators=(",", ":")).encode()
        (root / name).write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(8 * a.tensors))
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shards = sorted(root.glob("*.safetensors"))

    def baseline():
        for p in shards:
            with open(p, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                json.loads(f.read(n))
        json.loads((root / "model.safetensors.index.json").read_bytes())

    def reference():
        from safetensors import safe_open

        for p in shards:
            with safe_open(str(p), "np") as f:
                f.keys()

    timings: dict[str, list[float]] = {
        "read + json.loads of every header and the index": [],
        "safetensors safe_open + keys() of every shard": [],
        "streamck open_checkpoint": [],
    }
    for _ in range(a.reps):
        for label, fn in zip(timings, (baseline, reference, lambda: open_checkpoint(root)), strict=True):
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


def record(name: str, text: str) -> None:
    path = HERE / "RESULTS.md"
    doc = path.read_text() if path.exists() else "# Benchmark results\n"
    stamp = time.strftime("%Y-%m-%d")
    block = (
        f"<!-- case:{name} -->\n_Generated by `python bench/run.py {name}` on {stamp}._\n\n"
        f"{text}\n<!-- /case:{name} -->"
    )
    pattern = re.compile(f"<!-- case:{name} -->.*?<!-- /case:{name} -->", re.S)
    doc = pattern.sub(lambda m: block, doc) if pattern.search(doc) else doc.rstrip() + f"\n\n## {name}\n\n{block}\n"
    path.write_text(doc)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cases", nargs="*", choices=[[], *CASES], default=[])
    p.add_argument("--size", default="4GiB", help="rewrite: checkpoint size (a quarter-size one is run too)")
    p.add_argument("--embed", default="1GiB", help="rewrite: the largest tensor")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--settle", type=float, default=10.0, help="seconds of idle before each timed child")
    p.add_argument("--shards", type=int, default=1000, help="index: shard count")
    p.add_argument("--tensors", type=int, default=100, help="index: tensors per shard")
    p.add_argument("--no-record", action="store_true", help="print only; leave RESULTS.md alone")
    a = p.parse_args()
    for name in a.cases or CASES:
        with tempfile.TemporaryDirectory(prefix=f"streamck-bench-{name}-", dir=os.environ.get("BENCH_DIR")) as tmp:
            print(f"== {name}: {CASES[name].__doc__}", file=sys.stderr)
            text = CASES[name](a, Path(tmp))
        print(f"\n## {name}\n\n{text}\n")
        if not a.no_record:
            record(name, text)


if __name__ == "__main__":
    main()
