"""The benchmark harness stays runnable: its cheapest cases at toy sizes (figures not checked)."""

import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "run.py"


def test_bench_cases_run_at_toy_sizes(tmp_path):
    args = [
        "rewrite",
        "index",
        "lsdiff",
        "eagle4",
        "view",
        "--size",
        "8MiB",
        "--embed",
        "2MiB",
        "--reps",
        "1",
        "--settle",
        "0",
        "--shards",
        "5",
        "--tensors",
        "10",
        "--eagle-scale",
        "32",
        "--no-record",
    ]
    proc = subprocess.run(
        [sys.executable, str(BENCH), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "BENCH_DIR": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    for case in ("rewrite", "index", "lsdiff", "eagle4", "view"):
        assert f"## {case}" in proc.stdout
    assert "| streamck rewrite |" in proc.stdout and "torch not imported" in proc.stdout
