"""What the MLX tests run beside their models (tests/mlx_models.py): mlx-lm itself (``mlx[cpu]`` and
``mlx-lm`` on Linux CPUs, in a venv of their own kept in the fixture cache), driven by
tests/mlx_driver.py in one child process per test module: its ``mlx_lm.convert`` (the reference),
its ``mlx_lm.load`` of both outputs and their logits, and its reading of every tensor.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from fixture_cache import built_once, cache_dir

REPO = Path(__file__).resolve().parents[1]
MLX, MLX_LM, TRANSFORMERS = "0.32.4", "0.32.2", "5.19.0"  # transformers: the main venv's, for one tokenizer code


def mlx_python() -> Path:
    """The python of a venv holding mlx (CPU) and mlx-lm, made once per machine."""
    base = cache_dir() / f"venv-mlx-{MLX}-lm-{MLX_LM}"

    def build(tmp: Path) -> None:
        subprocess.run([sys.executable, "-m", "venv", str(tmp)], check=True, timeout=300)
        pins = [f"mlx[cpu]=={MLX}", f"mlx-lm=={MLX_LM}", f"transformers=={TRANSFORMERS}"]
        pip = [str(tmp / "bin" / "python"), "-m", "pip", "install", "-q", *pins]
        subprocess.run(pip, check=True, capture_output=True, timeout=900)

    return built_once(base, build) / "bin" / "python"


def run_jobs(jobs: list[dict], timeout: int = 600) -> list:
    """tests/mlx_driver.py's answers to ``jobs``, in order, from one child in the mlx venv."""
    cmd = [str(mlx_python()), str(REPO / "tests" / "mlx_driver.py")]
    started = time.monotonic()
    proc = subprocess.run(cmd, input=json.dumps(jobs), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    print(f"mlx driver: {len(jobs)} jobs in {time.monotonic() - started:.1f} s", file=sys.stderr)
    return json.loads(proc.stdout.splitlines()[-1])


def write_mlx(src: Path, out: Path, **options) -> list[Path]:
    """streamck's MLX folder of ``src`` at ``out``, as a library user asks for it."""
    import streamck

    return streamck.rewrite(src, out, format="mlx", **options).files
