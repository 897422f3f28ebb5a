"""A verl 0.9.1 FSDP2 actor checkpoint of a given size, written by verl's own engine on 2 gloo ranks.

    python bench/verl_ckpt.py DIR --size 1GiB

Runs tests/verl_child.py (verl's ``FSDPEngineWithLMHead`` + ``FSDPCheckpointManager``, one
training step; its CPU patches are said there) in verl's venv (``.venv/verl-0.9.1``, made by
scripts/test) on an untied Llama of about ``size`` bytes in F32, and leaves
``DIR/run/global_step_1/actor/``. Standalone: nothing here imports streamck.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VERL_PYTHON = ROOT / ".venv" / "verl-0.9.1" / "bin" / "python"
CHILD = ROOT / "tests" / "verl_child.py"


def dims(size: int) -> tuple[int, int, int, int]:
    """(hidden, intermediate, layers, vocab) of an F32 Llama of about ``size`` bytes."""
    hidden, inter, vocab = (1024, 2816, 32000) if size >= 256 << 20 else (64, 176, 1024)
    layer = 4 * (2 * hidden * hidden + 2 * hidden * hidden // 2 + 3 * hidden * inter)  # q, o; k, v at 2 of 4 heads
    return hidden, inter, max(1, (size - 4 * 2 * vocab * hidden) // layer), vocab


def make_verl(out: Path, size: int) -> Path:
    """The actor folder of a verl run of about ``size`` bytes under ``out`` (made once)."""
    actor = out / "run" / "global_step_1" / "actor"
    if actor.is_dir():
        return actor
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run([VERL_PYTHON, CHILD, "base", out, "llama", *map(str, dims(size))], check=True, env=env)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [VERL_PYTHON, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}", CHILD, out]
    subprocess.run(["timeout", "3000", *map(str, cmd), "fsdp2", "-1", "0"], check=True, env=env)
    return actor


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("dir", type=Path)
    p.add_argument("--size", default=str(1 << 30))
    a = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from streamck.writer import parse_size

    print(make_verl(a.dir, parse_size(a.size)))
