"""streamck benchmarks: each contender a child process, wall time and peak RSS from the OS.

    python bench/run.py                 # every case at its default size (a few minutes)
    python bench/run.py rewrite --size 8GiB --reps 5
    python bench/run.py index
    python bench/run.py dcp --size 2GiB      # torch DCP (sharded safetensors, .distcp) -> one file
    python bench/run.py zero --size 1GiB     # DeepSpeed ZeRO-3 checkpoint-N -> safetensors
    python bench/run.py fsdp --size 2GiB     # Trainer + FSDP2 checkpoint-N -> safetensors
    python bench/run.py clone                # on a reflink XFS loop image (root), 2 and 16 GiB
    python bench/run.py titan megatron       # torchtitan / Megatron checkpoints -> Hugging Face (156 MiB models)
    python bench/run.py lora --size 1GiB     # --merge-lora vs PEFT's merge_and_unload (needs peft)
    python bench/run.py moe                  # FSDP2 save of a Qwen3-MoE (fused experts) -> per-expert HF
    python bench/run.py verl --size 1GiB     # verl FSDP actor -> bf16 safetensors vs verl's merger (its venv)
    python bench/run.py count                # DeepSeek-V3's layout, 1.6k to 140k tensors: time per tensor
    python bench/run.py remote --size 1GiB   # s3 -> local, s3 -> s3 (SeaweedFS on loopback) vs s3fs get + rewrite

Contenders run interleaved (A B C A B C) after a settle pause; the table gives
medians and ratios against the baseline of the same run, and is written into
bench/RESULTS.md between that case's markers.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import math
import os
import re
import shlex
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
from dsv3 import make_dsv3  # noqa: E402
from loopfs import reflink_mount, used  # noqa: E402
from measure import PY, Runs, contend, cp_fsync, mib, plot, precompile, recache, run_child, streamck, table  # noqa: E402
from synth import make_bin, make_checkpoint, make_eagle4_draft, make_many_shards  # noqa: E402

from streamck.writer import parse_size  # noqa: E402

CASES: dict[str, Callable[[argparse.Namespace, Path], str]] = {}


def case(fn):
    CASES[fn.__name__.removeprefix("case_")] = fn
    return fn


def chart(a: argparse.Namespace, runs: dict, name: str, title: str) -> str:
    """The case's RSS-over-time plot, bench/results/NAME.png, drawn only when recording."""
    return "" if a.no_record else "\n\n" + plot(runs, HERE / "results" / f"{name}.png", title)


def checkpoints(a: argparse.Namespace, tmp: Path) -> tuple[int, int, Path, Path, int]:
    """The synthetic checkpoint of --size and a quarter-size one (memory must not grow between them)."""
    size, embed = parse_size(a.size), parse_size(a.embed)
    big = make_checkpoint(tmp / "big", size, embed)
    small = make_checkpoint(tmp / "small", size // 4, embed // 4)
    return size, embed, big, small, sum(p.stat().st_size for p in big.glob("*.safetensors"))


@case
def case_rewrite(a: argparse.Namespace, tmp: Path) -> str:
    """Unchanged-bytes rewrite (--strip-prefix model.) vs cp -r and the load/save route."""
    size, embed, big, small, data = checkpoints(a, tmp)
    out = tmp / "out"
    contenders = {
        "cp -r + sync": cp_fsync(big),
        "safetensors load/save": lambda o: [PY, str(HERE / "naive.py"), str(big), str(o)],
        "streamck rewrite": lambda o: streamck("rewrite", str(big), "-o", str(o), "--strip-prefix", "model.", "-q"),
    }
    runs = contend(contenders, out, a.reps, a.settle, (big,))
    _, s_rss = run_child(streamck("rewrite", str(small), "-o", str(out), "--strip-prefix", "model.", "-q"), a.settle)
    shutil.rmtree(out)
    return (
        f"Checkpoint: {data / 2**30:.2f} GiB in {len(list(big.glob('*.safetensors')))} shards, largest tensor "
        f"{embed / 2**30:.2f} GiB (F32). {a.reps} interleaved reps, {a.settle:.0f} s settle.\n\n"
        + table(runs, "cp -r + sync", data)
        + f"\n\nstreamck peak RSS as the checkpoint grows: {mib(s_rss)} at "
        f"{size // 4 / 2**30:.2f} GiB (largest tensor {embed // 4 / 2**30:.2f} GiB) vs "
        f"{mib(runs['streamck rewrite'].peak)} at {size / 2**30:.2f} GiB."
        + chart(a, runs, "rewrite", f"rewrite of a {data / 2**30:.1f} GiB checkpoint: RSS over time")
    )


@case
def case_cast(a: argparse.Namespace, tmp: Path) -> str:
    """F32 -> BF16 cast: cp of the source, in-memory torch copy_, load/.to/save, streamck --dtype bf16."""
    size, embed, big, small, data = checkpoints(a, tmp)
    out = tmp / "out"

    def rw(src):
        return lambda o: streamck(
            "rewrite", str(src), "-o", str(o), "--strip-prefix", "model.", "--dtype", "bf16", "-q"
        )

    contenders = {
        "cp -r + sync (source)": cp_fsync(big),
        "load_file/.to(bf16)/save_file": lambda o: [PY, str(HERE / "naive.py"), str(big), str(o), "--dtype", "bf16"],
        "streamck --dtype bf16": rw(big),
    }
    runs = contend(contenders, out, a.reps, a.settle, (big,))
    inmem = []
    for _ in range(a.reps):
        time.sleep(a.settle)
        proc = subprocess.run([PY, str(HERE / "inmem_cast.py"), str(data)], capture_output=True, text=True, check=True)
        inmem.append(float(proc.stdout))
    _, s_rss = run_child(rw(small)(out), a.settle)
    shutil.rmtree(out)
    _, base_rss = run_child([PY, "-c", "import numpy, streamck"], a.settle)
    base = runs["cp -r + sync (source)"].wall
    return (
        f"Checkpoint: {data / 2**30:.2f} GiB F32 in {len(list(big.glob('*.safetensors')))} shards, largest "
        f"tensor {embed / 2**30:.2f} GiB; output BF16. {a.reps} interleaved reps, {a.settle:.0f} s settle.\n\n"
        + table(runs, "cp -r + sync (source)", data)
        + f"\n\nIn-memory numpy conversion (streamck's converter) F32→BF16 of the same {data / 2**30:.2f} GiB "
        "(compute ceiling, no I/O): "
        f"median {statistics.median(inmem):.2f} s = {statistics.median(inmem) / base:.2f} × cp, "
        f"{data / statistics.median(inmem) / 1e9:.2f} GB/s.\n\n"
        f"streamck peak RSS: {mib(s_rss)} at {size // 4 / 2**30:.2f} GiB (largest tensor "
        f"{embed // 4 / 2**30:.2f} GiB) vs {mib(runs['streamck --dtype bf16'].peak)} at {size / 2**30:.2f} GiB; "
        f"`python -c 'import numpy, streamck'` alone peaks at {mib(base_rss)} (no torch is imported)."
        + chart(a, runs, "cast", f"F32→BF16 cast of {data / 2**30:.1f} GiB: RSS over time")
    )


@case
def case_cuda(a: argparse.Namespace, tmp: Path) -> str:
    """F32 -> BF16 cast with --device cpu vs --device cuda (skipped without a GPU)."""
    code = "import torch; print(torch.cuda.is_available() and torch.cuda.get_device_name(0))"
    probe = subprocess.run([PY, "-c", code], capture_output=True, text=True)
    gpu = probe.stdout.strip()
    if probe.returncode != 0 or gpu in ("", "False"):
        return "Not measured: no CUDA device on the machine that ran this (torch.cuda.is_available() is False)."
    size, embed = parse_size(a.size), parse_size(a.embed)
    big = make_checkpoint(tmp / "big", size, embed)
    data = sum(p.stat().st_size for p in big.glob("*.safetensors"))

    def cast(device: str) -> Callable[[Path], list[str]]:
        return lambda o: streamck("rewrite", str(big), "-o", str(o), "--dtype", "bf16", "--device", device, "-q")

    contenders = {
        "cp -r + sync (source)": cp_fsync(big),
        "streamck --device cpu": cast("cpu"),
        "streamck --device cuda": cast("cuda"),
    }
    runs = contend(contenders, tmp / "out", a.reps, a.settle, (big,))
    # The figures count only if the GPU wrote the CPU's bytes (bench data has no NaN).
    for device in ("cpu", "cuda"):
        subprocess.run(cast(device)(tmp / device), check=True)
    names = sorted(p.name for p in (tmp / "cpu").iterdir())
    same = names == sorted(p.name for p in (tmp / "cuda").iterdir()) and all(
        filecmp.cmp(tmp / "cpu" / n, tmp / "cuda" / n, shallow=False) for n in names
    )
    shutil.rmtree(tmp / "cpu")
    shutil.rmtree(tmp / "cuda")
    if not same:
        raise RuntimeError("--device cuda wrote other bytes than --device cpu")
    return (
        f"GPU: {gpu}. Checkpoint: {data / 2**30:.2f} GiB F32 → BF16. {a.reps} interleaved reps; "
        "the CUDA output is byte-identical to the CPU's.\n\n" + table(runs, "cp -r + sync (source)", data)
    )


@case
def case_bin(a: argparse.Namespace, tmp: Path) -> str:
    """PyTorch .bin -> model.safetensors: cp of the .bin, torch.load + save_file, streamck rewrite."""
    size, embed = parse_size(a.size), parse_size(a.embed)
    src = make_bin(tmp / "pytorch_model.bin", size, embed)
    data = src.stat().st_size
    out = tmp / "out.safetensors"
    contenders = {
        "cp + sync": cp_fsync(src),
        "torch.load + save_file": lambda o: [PY, str(HERE / "naive_bin.py"), str(src), str(o)],
        "streamck rewrite": lambda o: streamck("rewrite", str(src), "-o", str(o), "-q"),
    }
    runs = contend(contenders, out, a.reps, a.settle, (src,))
    return (
        f"Source: one {data / 2**30:.2f} GiB `torch.save` zip (F32, largest tensor {embed / 2**30:.2f} GiB). "
        f"{a.reps} interleaved reps, {a.settle:.0f} s settle.\n\n" + table(runs, "cp + sync", data)
    )


@case
def case_view(a: argparse.Namespace, tmp: Path) -> str:
    """A transposed (non-contiguous) view of --embed bytes in a .bin: gathered, and gathered + cast."""
    import torch

    side = int((parse_size(a.embed) // 4) ** 0.5)
    src = tmp / "view.bin"
    torch.save({"w": torch.empty(side, side).normal_().t()}, src)
    os.sync()
    data = src.stat().st_size
    contenders = {
        "cp + sync": cp_fsync(src),
        "torch.load + save_file": lambda o: [PY, str(HERE / "naive_bin.py"), str(src), str(o)],
        "streamck rewrite": lambda o: streamck("rewrite", str(src), "-o", str(o), "-q"),
        "streamck rewrite --dtype bf16": lambda o: streamck("rewrite", str(src), "-o", str(o), "--dtype", "bf16", "-q"),
    }
    runs = contend(contenders, tmp / "out.safetensors", a.reps, a.settle, (src,))
    return (
        f"Source: one `torch.save` zip holding a {side}×{side} F32 matrix saved transposed ({data / 2**30:.2f} GiB); "
        f"each output row takes one element of every source row. {a.reps} interleaved reps, "
        f"{a.settle:.0f} s settle.\n\n" + table(runs, "cp + sync", data)
    )


@case
def case_eagle4(a: argparse.Namespace, tmp: Path) -> str:
    """--plan eagle4 export of a 70B-target draft (scaled down by --eagle-scale) vs cp of its files."""
    src = make_eagle4_draft(tmp / "step", a.eagle_scale)
    weights = src / "model" / "consolidated"
    data = sum(p.stat().st_size for p in weights.iterdir())
    contenders = {
        "cp -r + sync": cp_fsync(weights),
        "streamck --plan eagle4": lambda o: streamck("rewrite", str(src), "-o", str(o), "--plan", "eagle4", "-q"),
    }
    runs = contend(contenders, tmp / "out", a.reps, a.settle, (weights,))
    return (
        f"Draft for a 70B target with every size divided by {a.eagle_scale} (BF16, {data / 2**30:.2f} GiB). "
        f"{a.reps} interleaved reps, {a.settle:.0f} s settle.\n\n" + table(runs, "cp -r + sync", data)
    )


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


@case
def case_index(a: argparse.Namespace, tmp: Path) -> str:
    """Indexing 1,000 shards × 100 tensors vs reading and json-parsing the same headers."""
    import gc

    import orjson

    sys.path.insert(0, str(HERE.parent))
    from streamck import open_checkpoint

    root = make_many_shards(tmp / "many", a.shards, a.tensors)
    shards = sorted(root.glob("*.safetensors"))

    def baseline():
        for p in shards:
            with open(p, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                json.loads(f.read(n))
        json.loads((root / "model.safetensors.index.json").read_bytes())

    def floor():
        # What any index must do, with no check at all: the index and the headers parsed by
        # the fastest parser on the list, the shard list taken from the index, one reference
        # per tensor, one dict of them, the collector kept off them as open_checkpoint does.
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

    def reference():
        from safetensors import safe_open

        for p in shards:
            with safe_open(str(p), "np") as f:
                f.keys()

    timings: dict[str, list[float]] = {
        "read + json.loads of every header and the index": [],
        "safetensors safe_open + keys() of every shard": [],
        "read + orjson.loads + a reference per tensor, no check": [],
        "streamck open_checkpoint": [],
    }
    assert len(floor()) == len(open_checkpoint(root).tensors)  # the floor does all of the work but the checks
    contenders = (baseline, reference, floor, lambda: open_checkpoint(root))
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


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


@case
def case_dcp(a: argparse.Namespace, tmp: Path) -> str:
    """torch DCP checkpoint (2 gloo ranks) -> one safetensors file: torch's consolidators vs streamck."""
    from dcp_ckpt import make_dcps, plan

    size = parse_size(a.size)
    big, small = make_dcps([(tmp / "big", size), (tmp / "small", size // 4)])
    hf, distcp = big["hf"], big["dcp"]
    data = _dir_bytes(hf)
    tensors = plan(size)
    largest = max(tensors, key=lambda t: math.prod(t[1]) * (4 if t[2] == "f32" else 2))
    largest_bytes = math.prod(largest[1]) * (4 if largest[2] == "f32" else 2)
    kinds = {p: sum(1 for t in tensors if t[3] == p) for p in ("S0", "S1", "R")}
    consolidate = str(HERE / "dcp_consolidate.py")
    contenders = {
        "cp -r + sync (sharded safetensors)": cp_fsync(hf),
        "torch consolidate_safetensors_files": lambda o: [PY, consolidate, "hf", str(hf), str(o)],
        "torch dcp_to_torch_save (.distcp)": lambda o: [PY, consolidate, "distcp", str(distcp), str(o)],
        "streamck rewrite (sharded safetensors)": lambda o: streamck("rewrite", str(hf), "-o", str(o), "-q"),
        "streamck rewrite (.distcp)": lambda o: streamck("rewrite", str(distcp), "-o", str(o), "-q"),
    }
    out = tmp / "out"
    runs = contend(contenders, out, a.reps, a.settle, (hf, distcp))
    _, s_hf = run_child(streamck("rewrite", str(small["hf"]), "-o", str(out), "-q"), a.settle)
    shutil.rmtree(out)
    _, s_dcp = run_child(streamck("rewrite", str(small["dcp"]), "-o", str(out), "-q"), a.settle)
    shutil.rmtree(out)
    return (
        f"Checkpoint: {len(tensors)} tensors ({kinds['S0']} Shard(0), {kinds['S1']} Shard(1), {kinds['R']} "
        f"replicated; BF16 and F32) as DTensors on 2 gloo ranks, saved by torch's `HuggingFaceStorageWriter("
        f"save_distributed=True)` ({data / 2**30:.2f} GiB in 2 shards) and `FileSystemWriter` "
        f"({_dir_bytes(distcp) / 2**30:.2f} GiB .distcp); largest tensor `{largest[0]}` "
        f"{largest_bytes / 2**20:.0f} MiB. Output: one file. {a.reps} interleaved reps, {a.settle:.0f} s settle.\n\n"
        + table(runs, "cp -r + sync (sharded safetensors)", data)
        + f"\n\nstreamck peak RSS as the checkpoint grows: {mib(s_hf)} (sharded safetensors) and {mib(s_dcp)} "
        f"(.distcp) at {_dir_bytes(small['hf']) / 2**30:.2f} GiB vs "
        f"{mib(runs['streamck rewrite (sharded safetensors)'].peak)} and "
        f"{mib(runs['streamck rewrite (.distcp)'].peak)} at {data / 2**30:.2f} GiB."
        + chart(a, runs, "dcp", f"consolidating a {data / 2**30:.1f} GiB DCP checkpoint: RSS over time")
    )


@case
def case_dcpview(a: argparse.Namespace, tmp: Path) -> str:
    """A DCP save whose blob is a transposed view (--embed bytes): gathered as a .pt view is."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    side = int((parse_size(a.embed) // 4) ** 0.5)
    src = tmp / "dcp"
    with warnings.catch_warnings():  # no_dist: "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore")
        state = {"w": torch.empty(side, side).normal_().t()}
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(src)), no_dist=True)
    os.sync()
    data = _dir_bytes(src)
    consolidate = str(HERE / "dcp_consolidate.py")
    contenders = {
        "cp -r + sync": cp_fsync(src),
        "torch dcp_to_torch_save": lambda o: [PY, consolidate, "distcp", str(src), str(o)],
        "streamck rewrite": lambda o: streamck("rewrite", str(src), "-o", str(o), "-q"),
    }
    runs = contend(contenders, tmp / "out.safetensors", a.reps, a.settle, (src,))
    return (
        f"Source: `dcp.save` of a {side}×{side} F32 matrix saved transposed ({data / 2**30:.2f} GiB .distcp, "
        f"strides (1, {side})); each output row takes one element of every source row. {a.reps} interleaved "
        f"reps, {a.settle:.0f} s settle.\n\n" + table(runs, "cp -r + sync", data)
    )


HUB_DIR = Path(os.environ.get("BENCH_PYDEPS", Path.home() / ".cache" / "streamck-bench" / "pydeps"))
HUB_INSTALL = f"{PY} -m pip install --no-deps --target {HUB_DIR} huggingface_hub"


def _hub_pythonpath() -> str | None:
    """zero_to_fp32.py's CLI needs huggingface_hub (its --max_shard_size, default 5GB, always
    imports it). The venv lacks it: a copy installed by HUB_INSTALL, outside the venv, is put on
    PYTHONPATH for those contenders only. None when neither has it."""
    for extra in ("", str(HUB_DIR)):
        env = {**os.environ, "PYTHONPATH": extra} if extra else None
        if subprocess.run([PY, "-c", "import huggingface_hub"], env=env, capture_output=True).returncode == 0:
            return extra
    return None


@case
def case_zero(a: argparse.Namespace, tmp: Path) -> str:
    """DeepSpeed ZeRO-3 (fp32, 2 ranks) checkpoint-N -> consolidated weights: zero_to_fp32.py vs streamck."""
    from zero_ckpt import dims, make_zero, weight_bytes

    size = parse_size(a.size)
    ck = make_zero(tmp / "run", size)
    step = ck / "global_step1"
    data = _dir_bytes(step)
    vocab, hidden, inter, layers = dims(size)
    master = sum(f.stat().st_size for f in step.glob("*optim_states.pt"))
    script = str(ck / "zero_to_fp32.py")  # DeepSpeed copies it there; run as a user does
    notes = []
    contenders: dict[str, Callable[[Path], list[str]]] = {"cp -r + sync (global_step1)": cp_fsync(step)}
    hub = _hub_pythonpath()
    if hub is None:
        notes.append(f"zero_to_fp32.py not run: it needs huggingface_hub (install: `{HUB_INSTALL}`).")
    else:
        env = f"PYTHONPATH={shlex.quote(hub)} " if hub else ""

        def z2f(*flags: str) -> Callable[[Path], list[str]]:
            return lambda o: [
                "sh",
                "-c",
                f"{env}{shlex.join([PY, script, str(ck), str(o), *flags])} && sync {shlex.quote(str(o))}/*",
            ]

        contenders["zero_to_fp32.py (default)"] = z2f()
        contenders["zero_to_fp32.py --max_shard_size 200MB"] = z2f("--max_shard_size", "200MB")
    probe = subprocess.run(streamck("ls", str(ck)), capture_output=True, text=True)
    if probe.returncode == 0:
        contenders["streamck rewrite"] = lambda o: streamck("rewrite", str(ck), "-o", str(o), "-q")
    else:
        err = (probe.stderr.strip().splitlines() or ["(no message)"])[-1]
        notes.append(f"streamck not run: `streamck ls checkpoint-1` failed (status {probe.returncode}: {err}).")
    runs = contend(contenders, tmp / "out", a.reps, a.settle, (step,))
    return (
        f"Checkpoint: trained one AdamW step and saved by DeepSpeed {_ds_version()} (ZeRO-3, fp32, 2 CPU ranks "
        f"on gloo): `checkpoint-1/global_step1` {data / 2**30:.2f} GiB, of which optimizer states "
        f"{master / 2**30:.2f} GiB (fp32 master + 2 Adam moments); fp32 weights "
        f"{weight_bytes(size) / 2**30:.2f} GiB "
        f"(embedding {vocab}×{hidden} tied to lm_head, {layers} layers of H={hidden}, I={inter}). "
        f"{a.reps} interleaved reps, {a.settle:.0f} s settle; throughput is of the step directory.\n\n"
        + table(runs, "cp -r + sync (global_step1)", data)
        + "".join(f"\n\n{n}" for n in notes)
        + chart(a, runs, "zero", f"consolidating ZeRO-3 ({data / 2**30:.1f} GiB step dir): RSS over time")
    )


MEGATRON = os.environ.get("STREAMCK_MEGATRON_PATH", str(HERE.parent / ".venv" / "megatron-core-0.19.2"))


def _with_path(extra: str, cmd: list[str]) -> list[str]:
    """``cmd`` with ``extra`` put before PYTHONPATH (a trainer installed outside the venv)."""
    path = os.pathsep.join(p for p in (extra, os.environ.get("PYTHONPATH", "")) if p)
    return ["env", f"PYTHONPATH={path}", *cmd]


def _trainer_run(what: str, root: Path, params: int, extra: str = "") -> tuple:
    """A bench checkpoint written by the trainer's own code (bench/trainer_ckpt.py); its dims."""
    cmd = _with_path(extra, [PY, str(HERE / "trainer_ckpt.py"), what, str(root), str(params)])
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{what} checkpoint failed:\n{done.stderr[-4000:]}")
    return tuple(json.loads(done.stdout.strip().splitlines()[-1]))


def _params(size: str) -> int:
    return parse_size(size) // 4  # F32


@case
def case_titan(a: argparse.Namespace, tmp: Path) -> str:
    """torchtitan 0.3.0 step (FSDP2, 2 gloo ranks) -> Hugging Face: convert_to_hf.py's route vs --plan."""
    dims = _trainer_run("titan", tmp / "run", _params(a.size))
    step, config = tmp / "run" / "bench" / "checkpoint" / "step-1", tmp / "run" / "bench" / "config.json"
    data = _dir_bytes(step)
    ckpt = str(HERE / "trainer_ckpt.py")
    contenders = {
        "cp -r + sync (step-1)": cp_fsync(step),
        "torchtitan convert_to_hf.py route": lambda o: [PY, ckpt, "convert_to_hf", str(step), json.dumps(dims), str(o)],
        "streamck --plan torchtitan-llama3": lambda o: streamck(
            "rewrite", str(step), "-o", str(o), "--plan", "torchtitan-llama3", "--hf-config", str(config), "-q"
        ),
    }
    runs = contend(contenders, tmp / "out", a.reps, a.settle, (step,))
    _, dim, nh, nkv, hd, hidden, layers, vocab, _ = dims
    model = 4 * (2 * vocab * dim + layers * (2 * dim * nh * hd + 2 * dim * nkv * hd + 3 * dim * hidden + 2 * dim) + dim)
    return (
        f"Checkpoint: a Llama 3 ({layers} layers, dim {dim}, {nh} heads / {nkv} KV heads, FFN {hidden}, vocab "
        f"{vocab}; F32 weights {model / 2**20:.0f} MiB) trained one AdamW step and saved by torchtitan 0.3.0's "
        f"CheckpointManager (FSDP2, 2 gloo ranks): `step-1` {data / 2**20:.0f} MiB with the optimizer state. "
        f"Output: the Hugging Face model (q/k rows RoPE-reordered). {a.reps} interleaved reps, {a.settle:.0f} s "
        "settle.\n\n" + table(runs, "cp -r + sync (step-1)", data)
    )


@case
def case_megatron(a: argparse.Namespace, tmp: Path) -> str:
    """Megatron-LM's training loop (pretrain, torch_dist, PP=2) -> HF: megatron-core's load + save vs --plan."""
    script, root = str(HERE / "megatron_train.py"), tmp / "run"
    ranks = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script]
    done = subprocess.run(_with_path(MEGATRON, [*ranks, "train", str(root), str(_params(a.size))]), capture_output=True,
                          text=True)  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"megatron training failed:\n{done.stderr[-4000:]}")
    dims = json.loads((root / "dims.json").read_text())
    run, step = root / "bench", root / "bench" / "iter_0000001"
    data = _dir_bytes(step)
    contenders = {
        "cp -r + sync (iter_0000001)": cp_fsync(step),
        "load whole model, split, save (Bridge route)": lambda o: _with_path(
            MEGATRON, [PY, script, "load", str(root), json.dumps(dims), str(o)]
        ),
        "streamck --plan megatron-gpt": lambda o: streamck(
            "rewrite", str(run), "-o", str(o), "--plan", "megatron-gpt", "-q"
        ),
    }
    runs = contend(contenders, tmp / "out", a.reps, a.settle, (step,))
    layers, dim, nh, nkv, _, hidden, vocab, padded, *_ = dims
    return (
        f"Checkpoint: a Llama-style GPT ({layers} layers, hidden {dim}, {nh} heads / {nkv} query groups, FFN "
        f"{hidden}, vocab {vocab} padded to {padded}; F32) trained one Adam step by Megatron-LM's own `pretrain` "
        f"(megatron-core 0.19.2's `megatron.training`, `--ckpt-format torch_dist`, PP=2 on 2 gloo ranks): "
        f"`iter_0000001` {data / 2**20:.0f} MiB with the optimizer state. Output: the Hugging Face model (qkv split "
        f"per group, gate/up split, vocab trimmed; the config from the run's args). {a.reps} interleaved reps, "
        f"{a.settle:.0f} s settle.\n\n" + table(runs, "cp -r + sync (iter_0000001)", data)
    )


def _rewrite_jobs(src: Path, jobs: int, extra: list[str]) -> Callable[[Path], list[str]]:
    # --jobs writes output shards at once: the output is split into 8 of them.
    shard = str(sum(p.stat().st_size for p in src.glob("*.safetensors")) // 8)
    return lambda o: streamck(
        "rewrite", str(src), "-o", str(o), "-q", "--jobs", str(jobs), "--max-shard-size", shard, *extra
    )


@case
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


@case
def case_fsdp(a: argparse.Namespace, tmp: Path) -> str:
    """Trainer + FSDP2 checkpoint-N (SHARDED_STATE_DICT, 2 ranks) -> safetensors: merge-weights vs streamck."""
    from fsdp_ckpt import make_fsdp

    size = parse_size(a.size)
    ck, small = make_fsdp(tmp / "big", size), make_fsdp(tmp / "small", size // 4)
    model = ck / "pytorch_model_fsdp_0"
    data = _dir_bytes(model)
    merge = str(Path(PY).with_name("accelerate"))
    contenders = {
        "cp -r + sync (pytorch_model_fsdp_0)": cp_fsync(model),
        # merge_fsdp_weights: loads the whole state dict, then saves it; fsync as the others do
        "accelerate merge-weights": lambda o: ["sh", "-c", f'"{merge}" merge-weights "{model}" "{o}" && sync "{o}"/*'],
        "streamck rewrite checkpoint-N": lambda o: streamck("rewrite", str(ck), "-o", str(o), "-q"),
        "accelerate merge-weights --help (its start-up alone)": lambda o: [merge, "merge-weights", "--help"],
    }
    out = tmp / "out"
    runs = contend(contenders, out, a.reps, a.settle, (model,))
    # The figures count only if both wrote the same tensors, bit for bit.
    for label, o in (("accelerate merge-weights", tmp / "m"), ("streamck rewrite checkpoint-N", tmp / "s")):
        subprocess.run(contenders[label](o), check=True, capture_output=True)
    subprocess.run(streamck("diff", str(tmp / "m"), str(tmp / "s"), "--data"), check=True, capture_output=True)
    _, s_small = run_child(streamck("rewrite", str(small), "-o", str(out), "-q"), a.settle)
    shutil.rmtree(out)
    return (
        f"Checkpoint: `checkpoint-1/pytorch_model_fsdp_0/` as accelerate's `save_fsdp_model` writes it "
        f'(DCP of {{"model": get_model_state_dict(...)}}) from a Llama sharded by FSDP2 `fully_shard` '
        f"on 2 gloo ranks, F32, {data / 2**30:.2f} GiB in 2 .distcp files (bench/fsdp_ckpt.py). Output: a "
        "directory with model.safetensors, the same tensors bit for bit from both tools (`streamck diff --data`). "
        f"{a.reps} interleaved reps, {a.settle:.0f} s settle.\n\n"
        + table(runs, "cp -r + sync (pytorch_model_fsdp_0)", data)
        + f"\n\nstreamck peak RSS as the checkpoint grows: {mib(s_small)} at "
        f"{_dir_bytes(small / 'pytorch_model_fsdp_0') / 2**30:.2f} GiB "
        f"vs {mib(runs['streamck rewrite checkpoint-N'].peak)} at {data / 2**30:.2f} GiB."
        + chart(a, runs, "fsdp", f"merging a {data / 2**30:.1f} GiB FSDP checkpoint: RSS over time")
    )


@case
def case_moe(a: argparse.Namespace, tmp: Path) -> str:
    """FSDP2 dcp.save of a Qwen3-MoE (fused experts) -> per-expert HF: load + save_pretrained vs streamck."""
    from moe_ckpt import make_moe

    big, small = make_moe(tmp / "big", 16), make_moe(tmp / "small", 4)
    data = _dir_bytes(big)
    script = str(HERE / "moe_ckpt.py")
    contenders = {
        "cp -r + sync (the DCP save)": cp_fsync(big),
        "dcp_to_torch_save + load_state_dict + save_pretrained": lambda o: [PY, script, "route", str(big), str(o)],
        "streamck rewrite (per expert)": lambda o: streamck("rewrite", str(big), "-o", str(o), "-q"),
    }
    out = tmp / "out"
    runs = contend(contenders, out, a.reps, a.settle, (big,))
    # The figures count only if both wrote the same tensors, bit for bit.
    for label, o in (("dcp_to_torch_save + load_state_dict + save_pretrained", tmp / "r"),
                     ("streamck rewrite (per expert)", tmp / "s")):  # fmt: skip
        subprocess.run(contenders[label](o), check=True, capture_output=True)
    subprocess.run(streamck("diff", str(tmp / "r"), str(tmp / "s"), "--data"), check=True, capture_output=True)
    _, s_small = run_child(streamck("rewrite", str(small), "-o", str(out), "-q"), a.settle)
    shutil.rmtree(out)
    fused = 16 * 4096 * 2048 * 4
    return (
        f"Checkpoint: `dcp.save(model.state_dict())` of a transformers Qwen3-MoE (2 layers, hidden 2048, 16 "
        f"experts of hidden 2048, F32) sharded by FSDP2 `fully_shard` on 2 gloo ranks, {data / 2**30:.2f} GiB in "
        f"2 .distcp files, `config.json` beside (bench/moe_ckpt.py); each `experts.gate_up_proj` "
        f"{fused / 2**20:.0f} MiB, each `experts.down_proj` {fused / 2**21:.0f} MiB. Output: a directory with "
        "model.safetensors holding per-expert tensors as save_pretrained names them, the same tensors bit for bit "
        f"from both tools (`streamck diff --data`). {a.reps} interleaved reps, {a.settle:.0f} s settle.\n\n"
        + table(runs, "cp -r + sync (the DCP save)", data)
        + f"\n\nstreamck peak RSS as the fused tensors grow: {mib(s_small)} with 4 experts "
        f"(gate_up_proj {fused / 4 / 2**20:.0f} MiB, {_dir_bytes(small) / 2**30:.2f} GiB) vs "
        f"{mib(runs['streamck rewrite (per expert)'].peak)} with 16 ({fused / 2**20:.0f} MiB, {data / 2**30:.2f} GiB)."
        + chart(a, runs, "moe", f"per-expert export of a {data / 2**30:.1f} GiB MoE FSDP2 save: RSS over time")
    )


@case
def case_verl(a: argparse.Namespace, tmp: Path) -> str:
    """verl 0.9.1 FSDP2 actor (2 ranks) -> safetensors bf16: verl's model_merger vs streamck vs cp -r."""
    from verl_ckpt import VERL_PYTHON, make_verl

    actor = make_verl(tmp / "big", parse_size(a.size))
    data = sum(p.stat().st_size for p in actor.glob("model_world_size_*.pt"))
    merger = f'"{VERL_PYTHON}" -m verl.model_merger merge --backend fsdp --local_dir "{actor}" --target_dir'
    contenders = {
        "cp -r + sync (actor/)": cp_fsync(actor),
        # verl's merger torch.loads every rank file whole and always casts to bf16; fsync as the others do
        "verl model_merger merge --backend fsdp": lambda o: ["sh", "-c", f'{merger} "{o}" >/dev/null && sync "{o}"/*'],
        "streamck rewrite actor/ --dtype bf16": lambda o: streamck(
            "rewrite", str(actor), "-o", str(o), "--dtype", "bf16", "-q"
        ),
    }
    out = tmp / "out"
    runs = contend(contenders, out, a.reps, a.settle, (actor,))
    # The figures count only if both wrote the same tensors, bit for bit.
    for label, o in (
        ("verl model_merger merge --backend fsdp", tmp / "m"),
        ("streamck rewrite actor/ --dtype bf16", tmp / "s"),
    ):
        subprocess.run(contenders[label](o), check=True, capture_output=True)
    subprocess.run(streamck("diff", str(tmp / "m"), str(tmp / "s"), "--data"), check=True, capture_output=True)
    return (
        f"Checkpoint: `global_step_1/actor/` as verl 0.9.1's `FSDPCheckpointManager` writes it (verl's FSDP2 engine, "
        f"2 gloo ranks, one training step; bench/verl_ckpt.py), an untied Llama, F32, {data / 2**30:.2f} GiB in 2 "
        "model rank files (optimizer files beside them, not read). Output: bf16 model.safetensors + config, the same "
        f"tensors bit for bit from both tools (`streamck diff --data`). {a.reps} interleaved reps, {a.settle:.0f} s "
        "settle.\n\n" + table(runs, "cp -r + sync (actor/)", data)
    )


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


@case
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


def _lora_inputs(tmp: Path, size: int, kinds: tuple[str, ...] = ("lora", "dora")) -> tuple[Path, ...]:
    """A bf16 Llama base of ``size`` bytes and PEFT adapters on every linear (LoRA, DoRA; r=16)."""
    make = [PY, str(HERE / "lora_ckpt.py")]
    base = tmp / f"base-{size}"
    subprocess.run([*make, "base", str(base), str(size)], check=True)
    for kind in kinds:
        flags = ["--dora"] if kind == "dora" else []
        subprocess.run(
            [*make, "adapter", str(base), str(tmp / f"{kind}-{size}"), *flags], check=True, capture_output=True
        )
    return base, *(tmp / f"{kind}-{size}" for kind in kinds)


@case
def case_lora(a: argparse.Namespace, tmp: Path) -> str:
    """--merge-lora (LoRA and DoRA on every linear, r=16) vs PEFT's merge_and_unload route vs cp -r of the base."""
    size = parse_size(a.size)
    base, lora, dora = _lora_inputs(tmp, size)
    data = _dir_bytes(base)
    peft = str(HERE / "lora_ckpt.py")
    contenders = {
        "cp -r + sync (base)": cp_fsync(base),
        "PEFT merge_and_unload + save_pretrained (LoRA)": lambda o: [PY, peft, "peft", str(base), str(lora), str(o)],
        "streamck --merge-lora (LoRA)": lambda o: streamck(
            "rewrite", str(base), "-o", str(o), "--merge-lora", str(lora), "-q"
        ),
        "streamck --merge-lora --merge-engine numpy (LoRA)": lambda o: streamck(
            "rewrite", str(base), "-o", str(o), "--merge-lora", str(lora), "--merge-engine", "numpy", "-q"
        ),
        "PEFT merge_and_unload + save_pretrained (DoRA)": lambda o: [PY, peft, "peft", str(base), str(dora), str(o)],
        "streamck --merge-lora (DoRA)": lambda o: streamck(
            "rewrite", str(base), "-o", str(o), "--merge-lora", str(dora), "-q"
        ),
    }
    out = tmp / "out"
    runs = contend(contenders, out, a.reps, a.settle, (base, lora, dora))
    exact = []
    for kind, adapter in (("LoRA", lora), ("DoRA", dora)):  # the outputs themselves, once more, bit for bit
        subprocess.run(
            streamck("rewrite", str(base), "-o", str(out / "s"), "--merge-lora", str(adapter), "-q"), check=True
        )
        subprocess.run([PY, peft, "peft", str(base), str(adapter), str(out / "p")], check=True, capture_output=True)
        same = subprocess.run([PY, peft, "same", str(out / "s"), str(out / "p")]).returncode == 0
        exact.append(f"{kind} {'bit-identical to' if same else 'DIFFERS from'} PEFT's")
        shutil.rmtree(out)
    small, s_lora = _lora_inputs(tmp, size // 4, ("lora",))
    _, rss = run_child(streamck("rewrite", str(small), "-o", str(out), "--merge-lora", str(s_lora), "-q"), a.settle)
    shutil.rmtree(out)
    small_bytes, shards = _dir_bytes(small), len(list(base.glob("*.safetensors")))
    shutil.rmtree(small)  # room for the 4x base
    shutil.rmtree(base)
    big, b_lora = _lora_inputs(tmp, size * 4, ("lora",))  # torch's import is paid once: the ratio at 4x
    large = {
        "cp -r + sync (base)": cp_fsync(big),
        "streamck --merge-lora (LoRA)": lambda o: streamck(
            "rewrite", str(big), "-o", str(o), "--merge-lora", str(b_lora), "-q"
        ),
    }
    large["streamck --merge-lora --merge-engine numpy (LoRA)"] = lambda o: streamck(
        "rewrite", str(big), "-o", str(o), "--merge-lora", str(b_lora), "--merge-engine", "numpy", "-q"
    )
    big_runs = contend(large, out, a.reps, a.settle, (big, b_lora))
    _, torch_rss = run_child([PY, "-c", "import torch"], a.settle)
    return (
        f"Base: bf16 Llama, {data / 2**30:.2f} GiB in {shards} shards (hidden 1024, "
        f"MLP 2816, vocab 32000); adapters by PEFT {_peft_version()} on every linear, r=16. "
        f"{a.reps} interleaved reps, {a.settle:.0f} s settle. Outputs: {'; '.join(exact)} output.\n\n"
        + table(runs, "cp -r + sync (base)", data)
        + f"\n\nThe same at {_dir_bytes(big) / 2**30:.2f} GiB (streamck and cp only):\n\n"
        + table(big_runs, "cp -r + sync (base)", _dir_bytes(big))
        + f"\n\nstreamck peak RSS as the base grows (LoRA): {mib(rss)} at {small_bytes / 2**30:.2f} GiB, "
        f"{mib(runs['streamck --merge-lora (LoRA)'].peak)} at {data / 2**30:.2f} GiB, "
        f"{mib(big_runs['streamck --merge-lora (LoRA)'].peak)} at {_dir_bytes(big) / 2**30:.2f} GiB; "
        f"`python -c 'import torch'` alone peaks at {mib(torch_rss)}."
        + chart(a, runs, "lora", f"merging a LoRA adapter into a {data / 2**30:.1f} GiB base: RSS over time")
    )


@case
def case_quant(a: argparse.Namespace, tmp: Path) -> str:
    """bf16 Llama (in shards, and as one file) -> FP8_BLOCK and NVFP4A16: llm-compressor's
    model_free_ptq vs streamck --quantize vs cp -r of the base."""
    size = parse_size(a.size)
    sharded, one = tmp / "sharded", tmp / "one"
    subprocess.run([PY, str(HERE / "lora_ckpt.py"), "base", str(sharded), str(size)], check=True)
    subprocess.run(streamck("rewrite", str(sharded), "-o", str(one), "-q"), check=True)  # one model.safetensors
    out, sections = tmp / "out", []
    for scheme in a.schemes.split(","):
        for label, base in (("in shards", sharded), ("one file", one)):
            runs, verdict = _quant_runs(a, base, scheme, out)
            shards = len(list(base.glob("*.safetensors")))
            sections.append(
                f"{scheme}, base {label} ({shards} file{'s' if shards > 1 else ''}): outputs {verdict} (every "
                f"tensor under `diff --data`, and config.json byte for byte).\n\n"
                + table(runs, "cp -r + sync (base)", _dir_bytes(base))
            )
        floor = subprocess.run([PY, str(HERE / "quant_floor.py"), str(sharded), scheme], check=True,
                               capture_output=True, text=True)  # fmt: skip
        f = json.loads(floor.stdout)
        sections.append(
            f"{scheme} floor on this machine (bench/quant_floor.py: the same arithmetic on the weights in "
            f"memory, no file read or written): {f['arithmetic']:.2f} s; a single `.to(float8_e4m3fn)` pass "
            f"over them {f['one_cast']:.2f} s."
        )
    _, torch_rss = run_child([PY, "-c", "import torch"], a.settle)
    return (
        f"Base: bf16 Llama by bench/lora_ckpt.py, {_dir_bytes(sharded) / 2**30:.2f} GiB (hidden 1024, MLP 2816, "
        f"vocab 32000), with the default ignore list (lm_head, model.embed_tokens, re:.*mlp.gate$). "
        f"{a.reps} interleaved reps, {a.settle:.0f} s settle. "
        f"`python -c 'import torch'` alone peaks at {mib(torch_rss)}.\n\n" + "\n\n".join(sections)
    )


def _quant_runs(a: argparse.Namespace, base: Path, scheme: str, out: Path) -> tuple[dict, str]:
    """One scheme on one base: the three contenders interleaved, then both outputs compared once."""
    # streamck's default ignore list on this base (the head, the embeddings, a MoE router)
    ptq, ignore = str(HERE / "quant_ckpt.py"), ("lm_head", "model.embed_tokens", "re:.*mlp.gate$")
    ours = f"streamck --quantize {scheme}"
    contenders = {
        "cp -r + sync (base)": cp_fsync(base),
        f"model_free_ptq {scheme}": lambda o: [PY, ptq, "ptq", str(base), str(o), scheme, *ignore],
        ours: lambda o: streamck("rewrite", str(base), "-o", str(o), "--quantize", scheme, "-q"),
    }
    runs = contend(contenders, out, a.reps, a.settle, (base,))
    subprocess.run([PY, ptq, "ptq", str(base), str(out / "p"), scheme, *ignore], check=True)
    subprocess.run(contenders[ours](out / "s"), check=True)
    same = subprocess.run(streamck("diff", str(out / "s"), str(out / "p"), "--data", "-q"), capture_output=True)
    config = (out / "s" / "config.json").read_bytes() == (out / "p" / "config.json").read_bytes()
    shutil.rmtree(out)
    return runs, "equal" if same.returncode == 0 and config else "NOT equal"


def _remote_runs(contenders: dict, reps: int, settle: float, proxy, cleanup: Callable[[], None]) -> tuple[dict, dict]:
    """``contenders`` (label -> argv) run ``reps`` times interleaved, ``cleanup`` after each;
    their runs, and the bytes each moved through the server's proxy (last run: down, up)."""
    runs = {label: Runs(label) for label in contenders}
    moved = {}
    for rep in range(reps):
        for label, cmd in contenders.items():
            proxy.reset()
            wall, rss = run_child(cmd, settle, runs[label].trace)
            runs[label].walls.append(wall)
            runs[label].rss.append(rss)
            moved[label] = (proxy.down, proxy.up)
            print(f"  rep {rep + 1}/{reps} {label:<40} {wall:7.2f} s {mib(rss):>9}", file=sys.stderr)
            cleanup()
    return runs, moved


@case
def case_remote(a: argparse.Namespace, tmp: Path) -> str:
    """s3 -> local and s3 -> s3 on SeaweedFS (loopback): streamck in one pass vs s3fs get + local rewrite (+ put)."""
    from seaweed import start

    size = parse_size(a.size)
    src = make_checkpoint(tmp / "src", size, min(parse_size(a.embed), size // 8))
    data = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    server = start(tmp / "s3")
    saved = dict(os.environ)
    try:
        bucket, fs = server.bucket(), server.fs()
        fs.put(f"{src}/", f"{bucket}/src/", recursive=True)
        os.environ.update(server.env(counted=True))  # every contender through the counting proxy
        url, out, dl = f"s3://{bucket}/src", tmp / "out", tmp / "dl"
        get = f"{PY} -c 'import s3fs, sys; s3fs.S3FileSystem().get(sys.argv[1], sys.argv[2], recursive=True)'"
        put = f"{PY} -c 'import s3fs, sys; s3fs.S3FileSystem().put(sys.argv[1], sys.argv[2], recursive=True)'"
        rw = f"{PY} -m streamck rewrite -q --strip-prefix model."
        drop = ["--drop", "*.mlp.*"]

        def cleanup() -> None:
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(dl, ignore_errors=True)
            if fs.exists(f"{bucket}/out"):
                fs.rm(f"{bucket}/out", recursive=True)
            fs.invalidate_cache()

        ours = ["rewrite", "-q", url, "--strip-prefix", "model.", "-o"]
        contenders = {
            "s3fs get (the download alone)": ["sh", "-c", f"{get} {url}/ {dl}/"],
            "s3fs get + local rewrite": ["sh", "-c", f"{get} {url}/ {dl}/ && {rw} {dl} -o {out}"],
            "streamck rewrite s3:// -> local": streamck(*ours, str(out)),
            "s3fs get + rewrite --drop mlp": ["sh", "-c", f"{get} {url}/ {dl}/ && {rw} {dl} -o {out} {' '.join(drop)}"],
            "streamck s3:// -> local --drop mlp": streamck(*ours, str(out), *drop),
            "s3fs get + rewrite + s3fs put": [
                "sh", "-c", f"{get} {url}/ {dl}/ && {rw} {dl} -o {out} && {put} {out}/ s3://{bucket}/out/",
            ],
            "streamck rewrite s3:// -> s3://": streamck(*ours, f"s3://{bucket}/out"),
        }  # fmt: skip
        runs, moved = _remote_runs(contenders, a.reps, a.settle, server.proxy, cleanup)
    finally:
        os.environ.clear()
        os.environ.update(saved)
        server.stop()
    rows = ["| contender | fetched | sent |", "|---|---|---|"]
    rows += [f"| {label} | {mib(down)} | {mib(up)} |" for label, (down, up) in moved.items()]
    return (
        f"Checkpoint: {data / 2**30:.2f} GiB in {len(list(src.glob('*.safetensors')))} shards (F32), in a bucket of "
        f"SeaweedFS {_weed_version()} on 127.0.0.1 through a counting proxy (every contender). Output: "
        f"`--strip-prefix model.`. {a.reps} interleaved reps, {a.settle:.0f} s settle.\n\n"
        + table(runs, "s3fs get (the download alone)", data)
        + "\n\nBytes through the server's port (the proxy's count, last run):\n\n"
        + "\n".join(rows)
    )


# A training step as dcp.save writes it: the model (F32 Linear layers of about --size) and AdamW's
# state (two moments, 2x the model's bytes), in one process; argv: DIR SIZE_BYTES.
_TRAIN_STEP = """
import sys, torch, torch.distributed.checkpoint as dcp
size, width = int(sys.argv[2]), 2048 if int(sys.argv[2]) >= 64 << 20 else 128
torch.manual_seed(0)
model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(max(1, size // (4 * width * width)))))
optim = torch.optim.AdamW(model.parameters())
model(torch.randn(2, width)).sum().backward()
optim.step()
dcp.save({"model": model.state_dict(), "optim": optim.state_dict()}, checkpoint_id=sys.argv[1])
"""


@case
def case_remote_train(a: argparse.Namespace, tmp: Path) -> str:
    """A model + AdamW DCP step in a bucket -> local safetensors: streamck (the model only) vs s3fs get alone."""
    from seaweed import start

    src = tmp / "step"
    subprocess.run([PY, "-c", _TRAIN_STEP, str(src), str(parse_size(a.size))], check=True, capture_output=True)
    data = _dir_bytes(src)
    server = start(tmp / "s3")
    saved = dict(os.environ)
    try:
        bucket, fs = server.bucket(), server.fs()
        fs.put(f"{src}/", f"{bucket}/step/", recursive=True)
        os.environ.update(server.env(counted=True))
        url, out, dl = f"s3://{bucket}/step", tmp / "out", tmp / "dl"
        get = f"{PY} -c 'import s3fs, sys; s3fs.S3FileSystem().get(sys.argv[1], sys.argv[2], recursive=True)'"

        def cleanup() -> None:
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(dl, ignore_errors=True)

        contenders = {
            "s3fs get (the download alone)": ["sh", "-c", f"{get} {url}/ {dl}/"],
            "streamck rewrite s3:// -> local": streamck("rewrite", "-q", url, "-o", str(out / "model.safetensors")),
        }
        runs, moved = _remote_runs(contenders, a.reps, a.settle, server.proxy, cleanup)
    finally:
        os.environ.clear()
        os.environ.update(saved)
        server.stop()
    rows = ["| contender | fetched |", "|---|---|"] + [f"| {k} | {mib(d)} |" for k, (d, _) in moved.items()]
    return (
        f"Checkpoint: one training step written by `dcp.save` (torch {_torch_version()}): F32 Linear layers and "
        f"AdamW's two moments, {data / 2**30:.2f} GiB in all, in a bucket of SeaweedFS {_weed_version()} on "
        f"127.0.0.1 through a counting proxy. Output: the model as one safetensors file. {a.reps} interleaved "
        f"reps, {a.settle:.0f} s settle.\n\n"
        + table(runs, "s3fs get (the download alone)", data)
        + "\n\nBytes through the server's port (the proxy's count, last run):\n\n"
        + "\n".join(rows)
    )


def _torch_version() -> str:
    proc = subprocess.run([PY, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True)
    return proc.stdout.strip() or "?"


def _weed_version() -> str:
    from seaweed import weed_binary

    proc = subprocess.run([weed_binary() or "weed", "version"], capture_output=True, text=True)
    found = re.search(r"\d+\.\d+", proc.stdout)
    return found.group(0) if found else "?"


def _peft_version() -> str:
    proc = subprocess.run([PY, "-c", "import peft; print(peft.__version__)"], capture_output=True, text=True)
    return proc.stdout.strip() or "?"


def _ds_version() -> str:
    proc = subprocess.run(
        [PY, "-c", "import importlib.metadata as m; print(m.version('deepspeed'))"], capture_output=True, text=True
    )
    return proc.stdout.strip() or "?"


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


DEFAULT_SIZE = {
    "dcp": "2GiB",
    "zero": "1GiB",
    "jobs": "2GiB",
    "fsdp": "2GiB",
    "clone": "2GiB,16GiB",
    "titan": "156MiB",
    "megatron": "156MiB",
    "lora": "1GiB",
    "verl": "1GiB",
    "remote": "1GiB",
    "remote_train": "256MiB",
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cases", nargs="*", choices=[[], *CASES], default=[])
    p.add_argument(
        "--size",
        default=None,
        help="checkpoint size (default: 4GiB; dcp 2GiB, zero 1GiB); rewrite, cast, dcp also run a quarter-size one",
    )
    p.add_argument("--embed", default="1GiB", help="rewrite: the largest tensor")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--settle", type=float, default=10.0, help="seconds of idle before each timed child")
    p.add_argument("--shards", type=int, default=1000, help="index: shard count")
    p.add_argument("--tensors", type=int, default=100, help="index: tensors per shard")
    p.add_argument("--schemes", default="FP8_BLOCK,NVFP4A16", help="quant: the schemes, comma-separated")
    p.add_argument("--eagle-scale", type=int, default=2, help="eagle4: divide the 70B-target draft's sizes by this")
    p.add_argument("--layers", default="0,5,8,20,61,92", help="count: DeepSeek-V3 decoder layer counts")
    p.add_argument("--no-record", action="store_true", help="print only; leave RESULTS.md alone")
    a = p.parse_args()
    size = a.size
    precompile(HERE.parent)
    for name in a.cases or CASES:
        a.size = size or DEFAULT_SIZE.get(name, "4GiB")
        with tempfile.TemporaryDirectory(prefix=f"streamck-bench-{name}-", dir=os.environ.get("BENCH_DIR")) as tmp:
            print(f"== {name}: {CASES[name].__doc__}", file=sys.stderr)
            text = CASES[name](a, Path(tmp))
        print(f"\n## {name}\n\n{text}\n")
        if not a.no_record:
            record(name, text)


if __name__ == "__main__":
    main()
