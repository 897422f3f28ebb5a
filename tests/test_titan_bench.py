"""bench/run.py's titan and megatron cases stay runnable: the trainers' own checkpoints at a toy
size, every contender once (figures not checked)."""

import os
from pathlib import Path

import pytest
from helpers import run_bench

BENCH = Path(__file__).resolve().parents[1] / "bench" / "run.py"
MEGATRON = os.environ.get("STREAMCK_MEGATRON_PATH", str(BENCH.parents[1] / ".venv" / "megatron-core-0.19.2"))
pytest.importorskip("torchtitan", reason="torchtitan==0.3.0 (scripts/test installs it)")


def test_titan_and_megatron_cases_run_at_toy_size(tmp_path):
    if not Path(MEGATRON, "megatron", "core").is_dir():
        pytest.skip(f"megatron-core 0.19.2 is not unpacked at {MEGATRON} (scripts/test does it)")
    args = ["titan", "megatron", "--size", "4MiB", "--reps", "1", "--settle", "0", "--no-record"]
    env = {**os.environ, "BENCH_DIR": str(tmp_path)}
    proc = run_bench(*args, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    titan, megatron = proc.stdout.split("## megatron")
    assert "| torchtitan convert_to_hf.py route |" in titan and "| streamck --plan torchtitan-llama3 |" in titan
    assert "| load whole model, split, save (Bridge route) |" in megatron
    assert "| streamck --plan megatron-gpt |" in megatron
