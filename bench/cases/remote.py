"""Checkpoints in a bucket (SeaweedFS on loopback, through a counting proxy): s3 -> local and
s3 -> s3 against s3fs get + a local rewrite (+ put), and a model + AdamW DCP step against the
download alone."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from harness import PY, Runs, case, dir_bytes, mib, parse_size, run_child, streamck, table, version_of
from synth import make_checkpoint


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


@case(size="1GiB")
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


@case(size="256MiB")
def case_remote_train(a: argparse.Namespace, tmp: Path) -> str:
    """A model + AdamW DCP step in a bucket -> local safetensors: streamck (the model only) vs s3fs get alone."""
    from seaweed import start

    src = tmp / "step"
    subprocess.run([PY, "-c", _TRAIN_STEP, str(src), str(parse_size(a.size))], check=True, capture_output=True)
    data = dir_bytes(src)
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
        f"Checkpoint: one training step written by `dcp.save` (torch {version_of('torch')}): F32 Linear layers and "
        f"AdamW's two moments, {data / 2**30:.2f} GiB in all, in a bucket of SeaweedFS {_weed_version()} on "
        f"127.0.0.1 through a counting proxy. Output: the model as one safetensors file. {a.reps} interleaved "
        f"reps, {a.settle:.0f} s settle.\n\n"
        + table(runs, "s3fs get (the download alone)", data)
        + "\n\nBytes through the server's port (the proxy's count, last run):\n\n"
        + "\n".join(rows)
    )


def _weed_version() -> str:
    from seaweed import weed_binary

    proc = subprocess.run([weed_binary() or "weed", "version"], capture_output=True, text=True)
    found = re.search(r"\d+\.\d+", proc.stdout)
    return found.group(0) if found else "?"
