"""Sharing blocks instead of copying them (#25): on a real XFS with reflink, mounted on a
loop device, a prefix strip shares every long tensor with its source and uses almost no
new block; where the filesystem cannot share, the output stays the reference writer's."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO, cli, save
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from streamck.cli import human
from streamck.fileio import can_clone

sys.path.insert(0, str(REPO / "bench"))
from loopfs import Unavailable, reflink_mount, used

BLOCK = 4096
MiB = 1 << 20


@pytest.fixture(scope="module")
def xfs(tmp_path_factory) -> Path:
    """A reflink XFS image mounted on a loop device (root and xfsprogs; skipped, with the
    reason, where it cannot be mounted; failed instead when STREAMCK_REQUIRE_XFS is set, as
    scripts/test sets it when it runs as root, so CI cannot skip it unseen)."""
    try:
        with reflink_mount(tmp_path_factory.mktemp("xfs"), 1 << 30) as mnt:
            yield mnt
    except Unavailable as e:
        if os.environ.get("STREAMCK_REQUIRE_XFS"):
            pytest.fail(f"STREAMCK_REQUIRE_XFS is set, and no reflink XFS can be mounted: {e}")
        pytest.skip(f"no reflink XFS here: {e}")


def tensors(prefix: str = "model.") -> dict[str, np.ndarray]:
    """Whole-block matrices (1-2 MiB) between small tensors that are not (norms, biases):
    every big tensor starts at its own offset modulo 4096."""
    rng = np.random.default_rng(0)
    out = {}
    for i in range(6):
        out[f"{prefix}layers.{i}.mlp.weight"] = rng.standard_normal((256 * (1 + i % 2), 1024), dtype=np.float32)
        out[f"{prefix}layers.{i}.norm.weight"] = rng.standard_normal(1000 + i, dtype=np.float32)
        out[f"{prefix}layers.{i}.bias"] = rng.standard_normal(37).astype(np.float16)
    return out


def save_layers(directory: Path, want: dict[str, np.ndarray], n: int) -> Path:
    """``want`` in ``n`` shards of consecutive layers with an index, as save_pretrained splits a model."""
    layer = lambda k: int(k.split(".")[2])  # noqa: E731
    weight_map = {}
    for i in range(n):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        part = {k: v for k, v in want.items() if layer(k) * n // 6 == i}
        save(directory / name, part)
        weight_map.update(dict.fromkeys(part, name))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def rewrite_json(src: Path, out: Path, *args) -> dict:
    proc = cli("rewrite", src, "-o", out, "--strip-prefix", "model.", "--json", *args, check=0)
    return json.loads(proc.stdout)


def names_in_order(path: Path) -> list[str]:
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    header = json.loads(path.read_bytes()[8 : 8 + n])
    header.pop("__metadata__", None)
    return sorted(header, key=lambda k: header[k]["data_offsets"])


def data_start(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def assert_same_tensors(out_files: list[Path], want: dict[str, np.ndarray]) -> None:
    """Through the reference reader: every tensor, bit for bit, and nothing else."""
    got = {}
    for f in out_files:
        got.update(load_file(f))
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and np.array_equal(got[k], v), k


def big_bytes(want: dict[str, np.ndarray]) -> int:
    return sum(v.nbytes for v in want.values() if v.nbytes >= MiB)


def test_keep_shards_prefix_strip_shares_on_xfs(xfs):
    src = save_layers(xfs / "keep-src", tensors(), 3)
    want = tensors("")
    before = used(xfs)
    report = rewrite_json(src, xfs / "keep-out", "--keep-shards")
    new = used(xfs) - before
    # Each kept file's data area is one run, shared whole but its first and last partial block.
    assert report["copied_bytes"] <= 2 * BLOCK * 3
    assert report["shared_bytes"] + report["copied_bytes"] == report["total_size"]
    assert new < MiB, f"{new} new bytes for {report['total_size']}"  # a copy: 9 MiB
    out = xfs / "keep-out"
    shards = sorted(out.glob("*.safetensors"))
    assert [p.name for p in shards] == [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    for kept, source in zip(shards, sorted(src.glob("*.safetensors")), strict=True):
        assert names_in_order(kept) == [n.removeprefix("model.") for n in names_in_order(source)]
        assert data_start(kept) % BLOCK == data_start(source) % BLOCK
        assert {index[n] for n in names_in_order(kept)} == {kept.name}
    assert_same_tensors(shards, want)


def test_default_layout_lines_up_on_xfs(xfs, tmp_path):
    """No --keep-shards: the one output file's header is padded into step with the source."""
    src = save(xfs / "one.safetensors", tensors())
    before = used(xfs)
    report = rewrite_json(src, xfs / "one-out.safetensors")
    new = used(xfs) - before
    out = xfs / "one-out.safetensors"
    save_file(tensors(""), tmp_path / "ref.safetensors", metadata={"format": "pt"})
    assert data_start(out) % BLOCK == data_start(src) % BLOCK != data_start(tmp_path / "ref.safetensors") % BLOCK
    assert report["shared_bytes"] >= big_bytes(tensors()) - 2 * BLOCK * 6
    assert new < MiB, f"{new} new bytes for {report['total_size']}"
    assert_same_tensors([out], tensors(""))
    with safe_open(out, "np") as f:
        assert f.metadata() == {"format": "pt"}


def test_drop_keeps_later_tensors_in_step_on_xfs(xfs):
    """A dropped 1 MiB tensor is a whole number of blocks: what follows stays in step."""
    src = save_layers(xfs / "drop-src", tensors(), 2)
    want = {k: v for k, v in tensors("").items() if k != "layers.2.mlp.weight"}
    report = rewrite_json(src, xfs / "drop-out", "--keep-shards", "--drop", "model.layers.2.mlp.weight")
    assert report["shared_bytes"] >= big_bytes(want) - 2 * BLOCK * 5
    assert_same_tensors(sorted((xfs / "drop-out").glob("*.safetensors")), want)


def test_casts_copy_and_parts_match_one_run_on_xfs(xfs):
    """Cast tensors are written as ever (nothing shared for them); --part K/N with
    --keep-shards gives a run's exact bytes, --verify and --jobs 2 included."""
    src = save_layers(xfs / "mix-src", tensors(), 3)
    cast = rewrite_json(src, xfs / "cast-out", "--keep-shards", "--dtype", "f16")
    assert cast["shared_bytes"] == 0
    one = rewrite_json(src, xfs / "one-run", "--keep-shards", "--verify", "--jobs", "2")
    assert one["shared_bytes"] >= big_bytes(tensors()) - 2 * BLOCK * 6
    for k in (1, 2):
        cli("rewrite", src, "-o", xfs / "parts", "--strip-prefix", "model.", "--keep-shards", f"--part={k}/2", check=0)
    assert sorted(p.name for p in (xfs / "parts").iterdir()) == sorted(p.name for p in (xfs / "one-run").iterdir())
    for p in (xfs / "one-run").iterdir():
        assert (xfs / "parts" / p.name).read_bytes() == p.read_bytes(), p.name


def test_no_sharing_keeps_the_reference_layout(tmp_path):
    """Where the filesystem cannot share (ext4, tmpfs), the output is save_file's, byte for byte."""
    if can_clone(tmp_path, BLOCK):
        pytest.skip(f"{tmp_path} can share blocks: this test needs a filesystem that cannot")
    src = save(tmp_path / "in.safetensors", tensors())
    proc = cli("rewrite", src, "-o", tmp_path / "out.safetensors", "--strip-prefix", "model.", check=0)
    assert f"0 B shared with the source, {human(sum(v.nbytes for v in tensors().values()))} copied" in proc.stderr
    save_file(tensors(""), tmp_path / "ref.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    keep = rewrite_json(src, tmp_path / "kept.safetensors", "--keep-shards")
    assert keep["shared_bytes"] == 0
    assert (tmp_path / "kept.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_keep_shards_keeps_each_source_file_and_its_order(tmp_path):
    """One output file per source file, its tensors in the source's order even where the
    new names sort otherwise (the default layout sorts them as save_file does)."""
    src = save_layers(tmp_path / "src", tensors(), 3)
    rename = ["--rename", r"^model\.layers\.(\d)\.mlp=z.\1.mlp"]
    cli("rewrite", src, "-o", tmp_path / "kept", "--keep-shards", *rename, check=0)
    cli("rewrite", src, "-o", tmp_path / "sorted", "--max-shard-size", "4MiB", *rename, check=0)
    renamed = {k.replace(f"model.layers.{k[13]}.mlp", f"z.{k[13]}.mlp"): v for k, v in tensors().items()}
    kept = sorted((tmp_path / "kept").glob("*.safetensors"))
    for out, source in zip(kept, sorted(src.glob("*.safetensors")), strict=True):
        order = names_in_order(source)
        assert names_in_order(out) == [n.replace(f"model.layers.{n[13]}.mlp", f"z.{n[13]}.mlp") for n in order]
    assert names_in_order(kept[0]) != sorted(names_in_order(kept[0]))
    assert_same_tensors(kept, renamed)


def test_keep_shards_refusals(tmp_path, dcp_ckpts):
    """What --keep-shards cannot write is refused up front: exit 2, one line, nothing left."""
    src = save_layers(tmp_path / "src", tensors(), 3)
    cases = [
        (src, tmp_path / "o1", ["--max-shard-size", "1GB"], "drop --max-shard-size"),
        (src, tmp_path / "o2.safetensors", [], "give a directory output"),
        (src, tmp_path / "o3", ["--format", "torch"], "writes safetensors files"),
        (dcp_ckpts["dcp"], tmp_path / "o4", [], "is assembled from 2 files"),
        (src, "-", [], "-o - is one stream"),
    ]
    for source, out, extra, message in cases:
        proc = cli("rewrite", source, "-o", out, "--keep-shards", *extra, check=2)
        errors = [line for line in proc.stderr.splitlines() if "error:" in line]
        assert len(errors) == 1 and message in errors[0] and "Traceback" not in proc.stderr, proc.stderr
        assert out == "-" or not out.exists()


def test_in_step_header_loads_and_a_refused_clone_copies(tmp_path):
    """Sharing forced on a filesystem that cannot: the padded header still loads through the
    reference reader, and each refused clone falls back to a copy of the same bytes."""
    from streamck.api import build_plan
    from streamck.writer.clone import Sharing, line_up
    from streamck.writer.layout import plan_shards
    from streamck.writer.shardwriter import ShardWriter

    if can_clone(tmp_path, BLOCK):
        pytest.skip(f"{tmp_path} can share blocks: this test needs a filesystem that cannot")
    src = save(tmp_path / "in.safetensors", tensors())
    plan = build_plan(src, rules=[{"strip_prefix": "model."}])
    sharing = Sharing(os.stat(tmp_path).st_dev)
    (shard,) = [line_up(s, sharing, 8) for s in plan_shards(plan)]
    assert 8 + struct.unpack("<Q", shard.header[:8])[0] == len(shard.header)
    assert len(shard.header) % BLOCK == data_start(src) % BLOCK
    assert shard.header.rstrip(b" ").endswith(b"}") and shard.header[-1:] == b" "
    writer = ShardWriter(1 << 20, None, False, lambda n: None, sharing)
    try:
        writer.write_file(shard, tmp_path / "out.safetensors")
    finally:
        writer.close()
    assert writer.shared == 0 and not sharing.may_share(shard.tensors[0])
    assert_same_tensors([tmp_path / "out.safetensors"], tensors(""))
    assert cli("diff", src, tmp_path / "out.safetensors", "--data", "--ignore", "*", check=0)


def test_bench_clone_case_runs(xfs):
    """bench/run.py clone stays runnable (at a toy size; its figures are not checked here)."""
    cmd = [sys.executable, str(REPO / "bench" / "run.py"), "clone", "--size", "8MiB", "--embed", "1MiB", "--reps", "1"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([*cmd, "--settle", "0", "--no-record"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| streamck --keep-shards |" in proc.stdout


def test_merged_tensors_are_computed_not_shared_on_xfs(xfs):
    """A LoRA merge keeps the base's dtype and its one-run source, yet its bytes are the
    merge's: nothing of it may be shared with the base (PEFT's own merge is the oracle)."""
    import lora_fixtures
    import torch
    from safetensors.torch import load_file as load_torch

    base = lora_fixtures.make_base(xfs / "lora-base", hidden_size=512, intermediate_size=1024, num_hidden_layers=1)
    adapter = lora_fixtures.make_adapter(base, xfs / "lora-adapter", target_modules=["gate_proj", "up_proj"])
    oracle = lora_fixtures.peft_merge(base, adapter, xfs / "lora-oracle")
    proc = cli("rewrite", base, "-o", xfs / "lora-out", "--keep-shards", "--merge-lora", adapter, "--json", check=0)
    report = json.loads(proc.stdout)
    assert 0 < report["shared_bytes"]  # the untouched tensors are still shared
    got, want = load_torch(xfs / "lora-out" / "model.safetensors"), load_torch(oracle / "model.safetensors")
    assert sorted(got) == sorted(want)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
