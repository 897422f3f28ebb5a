"""Rewrites of local checkpoints: unchanged bytes, the F32 -> BF16 cast (on the CPU and on a GPU),
a torch .bin, a transposed view, an EAGLE-4 draft export."""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from harness import (
    HERE,
    PY,
    case,
    chart,
    checkpoints,
    contend,
    cp_fsync,
    mib,
    parse_size,
    peak_at,
    run_child,
    streamck,
    table,
)
from synth import make_bin, make_checkpoint, make_eagle4_draft


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
    s_rss = peak_at(streamck("rewrite", str(small), "-o", str(out), "--strip-prefix", "model.", "-q"), out, a.settle)
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
    s_rss = peak_at(rw(small)(out), out, a.settle)
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
