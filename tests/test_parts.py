"""--jobs and --part K/N: the same bytes as one plain run, however the work is split."""

import filecmp
import subprocess
import sys

import numpy as np
import pytest
from helpers import cli, llama_like, save_sharded

import streamck
from streamck import OutputError, UsageError
from streamck.writer.layout import Shard
from streamck.writer.parts import assign


@pytest.fixture
def src(tmp_path):
    tensors = llama_like(layers=6, hidden=16, vocab=64)
    tensors["big"] = np.random.default_rng(1).standard_normal((300, 70)).astype(np.float32)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text('{"torch_dtype": "float32"}')
    return save_sharded(tmp_path / "src", tensors, 3)


def same_dirs(a, b) -> bool:
    names = sorted(p.name for p in a.iterdir())
    return names == sorted(p.name for p in b.iterdir()) and all(filecmp.cmp(a / n, b / n, shallow=False) for n in names)


@pytest.mark.parametrize("dtype", [None, "bf16"])
def test_jobs_write_the_same_bytes(src, tmp_path, dtype):
    one = streamck.rewrite(src, tmp_path / "one", max_shard_size="4KB", dtype=dtype, verify=True)
    four = streamck.rewrite(src, tmp_path / "four", max_shard_size="4KB", dtype=dtype, jobs=4, verify=True)
    assert len(one.files) > 6 and same_dirs(tmp_path / "one", tmp_path / "four")
    assert one.overflow == four.overflow


def test_parts_run_concurrently_equal_one_run(src, tmp_path):
    streamck.rewrite(src, tmp_path / "one", max_shard_size="4KB", dtype="bf16")
    n = 3
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "streamck",
                "rewrite",
                src,
                "-o",
                tmp_path / "parts",
                "--max-shard-size",
                "4KB",
                "--dtype",
                "bf16",
                "--part",
                f"{k}/{n}",
                "-q",
            ],
            stderr=subprocess.PIPE,
            text=True,
        )
        for k in range(1, n + 1)
    ]
    for p in procs:
        assert p.wait() == 0, p.stderr.read()
    assert same_dirs(tmp_path / "one", tmp_path / "parts")
    # A rerun of one part rewrites its own files only.
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "parts").iterdir()}
    r = cli("rewrite", src, "-o", tmp_path / "parts", "--max-shard-size", "4KB", "--dtype", "bf16", "--part", "2/3")
    assert r.returncode == 0, r.stderr
    after = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "parts").iterdir()}
    changed = {n for n in before if before[n] != after[n]}
    shards = sorted(p.name for p in (tmp_path / "parts").glob("model-*.safetensors"))
    assert changed and {n for n in changed if n in shards} < set(shards)
    assert same_dirs(tmp_path / "one", tmp_path / "parts")


def test_parts_are_balanced_and_deterministic():
    sizes = [50, 10, 40, 30, 30, 20, 10]
    shards = [Shard(f"s{i}", b"x" * size, []) for i, size in enumerate(sizes)]
    owners = assign(shards, 3)
    loads = [sum(s for s, o in zip(sizes, owners, strict=True) if o == p) for p in range(3)]
    assert owners == assign(shards, 3) and max(loads) - min(loads) <= 10 and sorted(set(owners)) == [0, 1, 2]


def test_part_refusals(src, tmp_path):
    with pytest.raises(UsageError, match="K/N"):
        streamck.rewrite(src, tmp_path / "o", part="4/3")
    with pytest.raises(UsageError, match="one file"):
        streamck.rewrite(src, tmp_path / "o.safetensors", part="1/2")
    r = cli("rewrite", src, "-o", "-", "--part", "1/2")
    assert r.returncode == 2 and "--part" in r.stderr and r.stderr.count("\n") == 1
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "NOTES.md").write_text("mine")
    with pytest.raises(OutputError, match="NOTES.md"):
        streamck.rewrite(src, tmp_path / "busy", part="1/2")
    # The library names its parameter (#49), the command line its flag.
    with pytest.raises(UsageError, match="^jobs 0: must be at least 1$"):
        streamck.rewrite(src, tmp_path / "o", jobs=0)
    r = cli("rewrite", src, "-o", tmp_path / "o", "--jobs", "0")
    assert r.returncode == 2 and "--jobs 0: must be at least 1" in r.stderr


def test_a_failing_job_stops_the_others_and_leaves_nothing(src, tmp_path, monkeypatch):
    from streamck.writer.shardwriter import ShardWriter

    real, calls = ShardWriter.write_file, []

    def failing(self, shard, path):
        calls.append(shard.filename)
        if shard.filename.startswith("model-00003"):
            raise OSError(28, "No space left on device", str(path))
        return real(self, shard, path)

    monkeypatch.setattr(ShardWriter, "write_file", failing)
    with pytest.raises(OutputError, match="No space left"):
        streamck.rewrite(src, tmp_path / "out", max_shard_size="4KB", jobs=3)
    assert not (tmp_path / "out").exists() and not any("streamck" in p.name for p in tmp_path.iterdir())


def test_the_index_appears_only_with_every_shard(src, tmp_path):
    out = tmp_path / "parts"
    first = streamck.rewrite(src, out, max_shard_size="4KB", part="1/2")
    assert not (out / "model.safetensors.index.json").exists() and first.files
    streamck.rewrite(src, out, max_shard_size="4KB", part="2/2")
    assert (out / "model.safetensors.index.json").exists()
    streamck.rewrite(src, tmp_path / "one", max_shard_size="4KB")
    assert same_dirs(tmp_path / "one", out)


def test_a_crash_while_replacing_leaves_no_index_over_old_shards(src, tmp_path, monkeypatch):
    import os

    out = tmp_path / "out"
    streamck.rewrite(src, out, max_shard_size="4KB")
    real, moved = os.replace, []

    def crash_midway(a, b):
        moved.append(b)
        if len(moved) == 3:
            raise OSError(5, "Input/output error", str(b))
        return real(a, b)

    monkeypatch.setattr(os, "replace", crash_midway)
    with pytest.raises(OutputError):
        streamck.rewrite(src, out, max_shard_size="4KB", dtype="bf16", force=True)
    assert not (out / "model.safetensors.index.json").exists()  # shards without an index: refused, never mixed


def test_parts_on_hosts_that_pad_differently_still_write_every_shard(src, tmp_path, monkeypatch):
    """A host whose filesystem clones pads headers (writer.clone.line_up), one that does not
    leaves them: the shards each part owns must not depend on that, or a shard is written
    twice or by nobody."""
    from dataclasses import replace

    from streamck.writer import destination  # where the layout meets the target (#49)
    from streamck.writer.layout import pad_header

    one = streamck.rewrite(src, tmp_path / "one", max_shard_size="4KB")
    names = sorted(p.name for p in one.files if p.name.endswith(".safetensors"))
    plain = destination.line_up

    def padded_last(shard, sharing, align):  # as if the last shard shared a long run
        if shard.filename != names[-1]:
            return plain(shard, sharing, align)
        return replace(shard, header=pad_header(shard.header, len(shard.header) + (1 << 20)))

    for k in (1, 2, 3):
        with monkeypatch.context() as m:
            if k == 1:
                m.setattr(destination, "line_up", padded_last)
            streamck.rewrite(src, tmp_path / "parts", max_shard_size="4KB", part=(k, 3))
    got = sorted(p.name for p in (tmp_path / "parts").iterdir() if p.name.endswith(".safetensors"))
    assert got == names
