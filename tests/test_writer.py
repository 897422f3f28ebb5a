"""The writer: byte identity with the reference, sharding, alignment, atomicity."""

import json
import os
import subprocess
import sys
from itertools import pairwise

import numpy as np
import pytest
from helpers import llama_like, metadata_of, raw_file, read_all, save, save_sharded
from safetensors import safe_open
from safetensors.numpy import save_file

from streamck import OutputError, Rule, Rules, UsageError, compile_plan, open_checkpoint, write_plan
from streamck.writer import parse_size

STRIP = Rules((Rule("strip_prefix", "model."),))


def run(src, out, rules=None, **kw):
    return write_plan(compile_plan(open_checkpoint(src), rules), out, **kw)


def test_a_chunk_below_one_byte_is_refused_before_any_file(tmp_path):
    src = save(tmp_path / "s.safetensors", {"a": np.ones(3)})
    with pytest.raises(UsageError, match="chunk 0"):
        run(src, tmp_path / "o.safetensors", chunk=0)
    assert not (tmp_path / "o.safetensors").exists()


def test_identical_to_reference_writer(tmp_path):
    tensors = llama_like()
    src = save(tmp_path / "src.safetensors", tensors)
    run(src, tmp_path / "out.safetensors", STRIP)
    expected = {k.removeprefix("model."): v for k, v in tensors.items()}
    save_file(expected, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_every_tensor_matches_source_through_reference_reader(tmp_path):
    tensors = llama_like(layers=3)
    save_sharded(tmp_path / "src", tensors, 3)
    run(tmp_path / "src", tmp_path / "out", Rules((Rule("drop", "*inv_freq"),)))
    got = read_all(tmp_path / "out" / "model.safetensors")
    assert sorted(got) == sorted(k for k in tensors if not k.endswith("inv_freq"))
    for k, v in got.items():
        assert v.dtype == tensors[k].dtype and np.array_equal(v, tensors[k])


def test_metadata_carried_and_format_added(tmp_path):
    src = save(tmp_path / "src.safetensors", {"a": np.zeros(2)}, metadata={"step": "7"})
    run(src, tmp_path / "out.safetensors")
    assert metadata_of(tmp_path / "out.safetensors") == {"step": "7", "format": "pt"}


def test_sharded_output_with_index(tmp_path):
    tensors = llama_like(layers=4)
    src = save(tmp_path / "src.safetensors", tensors)
    result = run(src, tmp_path / "out", max_shard_size=600)
    out = tmp_path / "out"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in tensors.values()) == result.total_size
    for name, shard in index["weight_map"].items():
        with safe_open(str(out / shard), "np") as f:
            assert np.array_equal(f.get_tensor(name), tensors[name])
    for shard in shards:  # each shard within the limit, unless one tensor alone exceeds it
        with safe_open(str(out / shard), "np") as f:
            sizes = [f.get_tensor(k).nbytes for k in f.keys()]
        assert sum(sizes) <= 600 or len(sizes) == 1


def test_tensor_larger_than_shard_gets_its_own(tmp_path):
    src = save(
        tmp_path / "s.safetensors",
        {"a": np.zeros(10, np.uint8), "b": np.zeros(1000, np.uint8), "c": np.zeros(10, np.uint8)},
    )
    run(src, tmp_path / "out", max_shard_size=100)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"]
    assert index["b"] != index["a"] and index["b"] != index["c"]
    assert len(set(index.values())) == 3


def test_two_runs_byte_identical_sharded(tmp_path):
    save_sharded(tmp_path / "src", llama_like(), 2)
    for name in ("o1", "o2"):
        run(tmp_path / "src", tmp_path / name, STRIP, max_shard_size=500)
    files = sorted(p.name for p in (tmp_path / "o1").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "o2").iterdir())
    for f in files:
        assert (tmp_path / "o1" / f).read_bytes() == (tmp_path / "o2" / f).read_bytes()


@pytest.mark.parametrize("align", [8, 64, 4096])
def test_header_align(tmp_path, align):
    tensors = llama_like()
    src = save(tmp_path / "s.safetensors", tensors)
    run(src, tmp_path / "o.safetensors", header_align=align)
    data = (tmp_path / "o.safetensors").read_bytes()
    assert (8 + int.from_bytes(data[:8], "little")) % align == 0
    got = read_all(tmp_path / "o.safetensors")
    assert all(np.array_equal(got[k], tensors[k]) for k in tensors)


def test_every_reference_dtype_is_carried(tmp_path):
    # Bytes for dtypes numpy lacks (BF16, F8, F4, F6, C64) are written by hand.
    from streamck.dtypes import BITS

    header, data, offset = {}, b"", 0
    for i, (dtype, bits) in enumerate(BITS.items()):
        numel = 8
        size = numel * bits // 8
        header[f"t{i}_{dtype}"] = {"dtype": dtype, "shape": [2, 4], "data_offsets": [offset, offset + size]}
        data += bytes((i + j) % 256 for j in range(size))
        offset += size
    src = raw_file(tmp_path / "s.safetensors", header, data)
    run(src, tmp_path / "o.safetensors")
    with safe_open(str(tmp_path / "o.safetensors"), "np") as f:
        assert sorted(f.keys()) == sorted(header)
    ckpt, out = open_checkpoint(src), open_checkpoint(tmp_path / "o.safetensors")
    for name in header:
        assert out.tensors[name].dtype == ckpt.tensors[name].dtype
        assert bytes(out.read(name)) == bytes(ckpt.read(name))


def test_existing_output_needs_force(tmp_path):
    src = save(tmp_path / "s.safetensors", {"a": np.ones(2)})
    (tmp_path / "o.safetensors").write_text("old")
    with pytest.raises(OutputError, match="already exists"):
        run(src, tmp_path / "o.safetensors")
    assert (tmp_path / "o.safetensors").read_text() == "old"
    run(src, tmp_path / "o.safetensors", force=True)
    assert np.array_equal(read_all(tmp_path / "o.safetensors")["a"], np.ones(2))


def test_force_replaces_a_directory_whole(tmp_path):
    save_sharded(tmp_path / "src", llama_like(), 2)
    run(tmp_path / "src", tmp_path / "out", max_shard_size=300)
    run(tmp_path / "src", tmp_path / "out", force=True)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if "streamck" in p.name]


def test_empty_existing_directory_is_fine(tmp_path):
    src = save(tmp_path / "s.safetensors", {"a": np.ones(2)})
    (tmp_path / "out").mkdir()
    run(src, tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").is_file()


@pytest.mark.parametrize("target", ["same", "symlink", "hardlink", "parent"])
def test_never_writes_over_the_source(tmp_path, target):
    src = save(tmp_path / "ck" / "s.safetensors", {"a": np.ones(2)})
    before = src.read_bytes()
    out = {
        "same": src,
        "symlink": tmp_path / "l.safetensors",
        "hardlink": tmp_path / "h.safetensors",
        "parent": tmp_path / "ck",
    }[target]
    if target == "symlink":
        out.symlink_to(src)
    if target == "hardlink":
        out.hardlink_to(src)
    with pytest.raises(OutputError, match="source"):
        run(src, out, force=True)
    assert src.read_bytes() == before


def test_no_temporary_left_after_success(tmp_path):
    src = save(tmp_path / "s.safetensors", {"a": np.ones(2)})
    run(src, tmp_path / "o.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.safetensors", "s.safetensors"]


def test_source_changed_during_run_is_detected(tmp_path):
    src = save(tmp_path / "s.safetensors", {"a": np.ones(2)})
    plan = compile_plan(open_checkpoint(src))
    save(src, {"a": np.zeros(2)})  # rewritten between indexing and writing: new inode/mtime
    with pytest.raises(Exception, match="changed"):
        write_plan(plan, tmp_path / "o.safetensors")
    assert not (tmp_path / "o.safetensors").exists()


@pytest.mark.parametrize("mode", ["copy_file_range", "sendfile", "buffer"])
def test_every_copy_mode_with_odd_chunks(tmp_path, mode):
    from streamck.source.header import TensorRef
    from streamck.source.reader import Reader

    data = bytes(range(256)) * 5
    (tmp_path / "src").write_bytes(data)
    ref = TensorRef("t", "U8", (1000,), tmp_path / "src", 3, 1003)
    with Reader(7, mode, copy_chunk=7) as reader, open(tmp_path / "dst", "wb") as dst:
        seen = []
        reader.copy(ref, dst.fileno(), seen.append)
    assert (tmp_path / "dst").read_bytes() == data[3:1003]
    assert sum(seen) == 1000 and max(seen) <= 7


def test_truncated_source_is_an_error(tmp_path):
    from streamck import CheckpointError
    from streamck.source.header import TensorRef
    from streamck.source.reader import COPY_MODES, Reader

    (tmp_path / "src").write_bytes(b"abc")
    ref = TensorRef("t", "U8", (10,), tmp_path / "src", 0, 10)
    for mode in COPY_MODES:
        with Reader(7, mode, copy_chunk=7) as reader, open(tmp_path / "dst", "wb") as dst:
            with pytest.raises(CheckpointError, match="ended before"):
                reader.copy(ref, dst.fileno())
        with Reader(4) as reader, pytest.raises(CheckpointError, match="ended before"):
            list(reader.windows(ref))


@pytest.mark.parametrize(
    ("text", "value"), [("5GB", 5 * 10**9), ("500MiB", 500 << 20), ("1024", 1024), ("1.5kb", 1500)]
)
def test_parse_size(text, value):
    assert parse_size(text) == value


def resident_bytes(path) -> int:

    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)], capture_output=True, text=True, check=True
    ).stdout
    return int(out.split()[0])


@pytest.mark.parametrize("drop", [False, True])
def test_drop_cache_releases_read_and_written_pages(tmp_path, monkeypatch, drop):
    import streamck.writer.shardwriter as sw

    monkeypatch.setattr(sw, "_DROP_EVERY", 1 << 20)  # exercise the periodic flush too
    tensors = {f"t{i}": np.random.default_rng(i).standard_normal(1 << 18).astype(np.float32) for i in range(8)}
    src = save(tmp_path / "s.safetensors", tensors)  # 8 MiB, just written: in the page cache
    fd = os.open(src, os.O_RDONLY)
    os.fsync(fd)  # clean, as a checkpoint on disk is: only clean pages can be dropped
    os.close(fd)
    run(src, tmp_path / "o.safetensors", drop_cache=drop)
    size = (tmp_path / "o.safetensors").stat().st_size
    resident = resident_bytes(tmp_path / "o.safetensors"), resident_bytes(src)
    if drop:
        assert max(resident) < size // 10
    else:  # the control: without the flag the pages stay, so the check above can fail
        assert min(resident) > size // 2
    got = read_all(tmp_path / "o.safetensors")
    assert all(np.array_equal(got[k], v) for k, v in tensors.items())


def test_progress_bar_counts_every_output_byte(tmp_path, capsys, monkeypatch):
    import streamck.writer.progress as wp

    counted = []
    real_close = wp.Bar.close

    def close(self):
        counted.append(self.bar.n)
        real_close(self)

    monkeypatch.setattr(wp.Bar, "close", close)
    src = save(tmp_path / "s.safetensors", llama_like())
    plan = compile_plan(open_checkpoint(src), Rules((Rule("cast", "*norm*=bf16"),)))  # copies and a cast
    write_plan(plan, tmp_path / "o.safetensors", progress=True, chunk=64)
    assert counted == [plan.total_size]
    assert "B/s" in capsys.readouterr().err


def test_header_over_the_readers_cap_is_refused_before_writing(tmp_path, monkeypatch):
    import streamck.source.header as header

    src = save_sharded(tmp_path / "s", llama_like(), 6)  # shard headers stay under the cap below
    monkeypatch.setattr(header, "MAX_HEADER", 512)  # a real cap is 100 MB: ~1M tensors in one file
    with pytest.raises(OutputError, match="above the 512-byte cap"):
        run(src, tmp_path / "o.safetensors")
    assert not (tmp_path / "o.safetensors").exists()
    run(src, tmp_path / "out", max_shard_size=200)  # small shards have small headers


def test_the_writer_counts_its_bytes_against_the_layout(tmp_path, monkeypatch):
    from streamck.source.reader import Reader

    src = save(tmp_path / "m.safetensors", {"a": np.arange(1000, dtype=np.float32)})
    real = Reader.copy

    def short(self, ref, out, progress=lambda n: None):  # a copy that silently loses its last bytes
        real(self, ref, out, progress)
        os.ftruncate(out, os.fstat(out).st_size - 4)
        os.lseek(out, 0, os.SEEK_END)

    monkeypatch.setattr(Reader, "copy", short)
    with pytest.raises(OutputError, match="wrote .* bytes where the layout has"):
        write_plan(compile_plan(open_checkpoint(src)), tmp_path / "out" / "o.safetensors")
    assert not (tmp_path / "out" / "o.safetensors").exists()


def test_writeback_starts_the_disk_on_each_written_range(tmp_path, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    from streamck.writer import shardwriter

    calls, seen = [], []
    real = shardwriter.start_writeback
    monkeypatch.setattr(shardwriter, "WRITEBACK_EVERY", 4096)
    monkeypatch.setattr(shardwriter, "start_writeback", lambda fd, off, n: calls.append((off, n)) or real(fd, off, n))
    with ThreadPoolExecutor(1) as pool:
        with open(tmp_path / "f", "wb") as f:
            # The requests run on the pool's thread; leaving the block waits for them all.
            with shardwriter.Writeback(f.fileno(), seen.append, pool) as writeback:
                for _ in range(5):
                    os.write(f.fileno(), bytes(3000))
                    writeback(3000)
        assert seen == [3000] * 5  # progress still counts every piece
        assert calls == [(0, 6000), (6000, 6000)]  # each range once, in order, never past what was written
        assert writeback.enabled is (sys.platform == "linux")
        r, w = os.pipe()
        try:
            with shardwriter.Writeback(w, seen.append, pool) as writeback:
                os.write(w, bytes(5000))
                writeback(5000)
            assert not writeback.enabled  # a pipe (-o -): no writeback, no error
        finally:
            os.close(r)
            os.close(w)


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_writer_asks_for_writeback_of_what_it_wrote(tmp_path, monkeypatch, fmt):
    # Small WRITEBACK_EVERY so the small fixture makes requests: they cover the file from
    # its start, in order, never past its end, and are all done before the run returns.
    import functools

    import streamck
    import streamck.source.reader as reader_module
    from streamck.writer import shardwriter

    calls = []
    real = shardwriter.start_writeback

    def record(fd, offset, length):
        calls.append((offset, length, os.fstat(fd).st_size))
        return real(fd, offset, length)

    monkeypatch.setattr(shardwriter, "WRITEBACK_EVERY", 4096)
    monkeypatch.setattr(shardwriter, "start_writeback", record)
    # The four tensors continue one another: one copy (#44), here in 4 KiB kernel-side pieces.
    monkeypatch.setattr(reader_module, "KERNEL_MIN", 4096)
    monkeypatch.setattr(shardwriter, "Reader", functools.partial(shardwriter.Reader, copy_chunk=4096))
    rng = np.random.default_rng(0)
    tensors = {f"w{i}": rng.standard_normal((32, 128)).astype(np.float32) for i in range(4)}  # 16 KiB each
    save(tmp_path / "src.safetensors", tensors)
    out = tmp_path / ("out.safetensors" if fmt == "safetensors" else "out.bin")
    streamck.rewrite(tmp_path / "src.safetensors", out)
    assert len(calls) > 1
    assert calls[0][0] == 0 and all(a[0] + a[1] == b[0] for a, b in pairwise(calls))
    assert all(offset + length <= size for offset, length, size in calls)
    assert calls[-1][0] + calls[-1][1] <= out.stat().st_size
    assert sorted(open_checkpoint(out).tensors) == sorted(tensors)
