"""The lazy index: every layout, and every index-time check."""

import json
import subprocess
import sys

import numpy as np
import pytest
from helpers import llama_like, raw_file, save, save_sharded

from streamck import CheckpointError, open_checkpoint


def test_single_file_index_matches_reference(tmp_path):
    tensors = llama_like()
    path = save(tmp_path / "m.safetensors", tensors)
    ckpt = open_checkpoint(path)
    assert sorted(ckpt.tensors) == sorted(tensors)
    for name, arr in tensors.items():
        ref = ckpt.tensors[name]
        assert ref.shape == arr.shape
        assert ref.nbytes == arr.nbytes
        assert bytes(ckpt.read(name)) == arr.tobytes()
    assert ckpt.metadata == {"format": "pt"}
    assert ckpt.total_size == sum(a.nbytes for a in tensors.values())


def test_read_gives_the_tensor_bytes(tmp_path):
    path = save(tmp_path / "m.safetensors", {"a": np.arange(10, dtype=np.int32), "b": np.ones(3, np.int8)})
    data = open_checkpoint(path).read("a")
    assert np.frombuffer(data, dtype=np.int32).tolist() == list(range(10))


@pytest.mark.parametrize("index", [True, False])
def test_sharded_directory(tmp_path, index):
    tensors = llama_like()
    save_sharded(tmp_path / "ck", tensors, 3, index=index)
    ckpt = open_checkpoint(tmp_path / "ck")
    assert sorted(ckpt.tensors) == sorted(tensors)
    assert len(ckpt.files) == 3
    for name, arr in tensors.items():
        assert bytes(ckpt.read(name)) == arr.tobytes()


def test_automodel_consolidated_dir(tmp_path):
    tensors = llama_like()
    save_sharded(tmp_path / "step" / "model" / "consolidated", tensors, 2)
    ckpt = open_checkpoint(tmp_path / "step")
    assert sorted(ckpt.tensors) == sorted(tensors)


def test_index_reads_no_tensor_data(tmp_path):
    # The kernel's count of bytes this process read (/proc/self/io rchar) across indexing
    # a file with 64 MiB of real data, in a child: reading the data would add 64 MiB.
    data = np.arange(16 << 20, dtype=np.float32)
    path = save(tmp_path / "big.safetensors", {"a": data, "b": data[:5]})
    code = (
        "import sys\n"
        "from streamck import open_checkpoint\n"
        "rchar = lambda: int(open('/proc/self/io').read().split('rchar: ')[1].split()[0])\n"
        "open_checkpoint(sys.argv[1])\n"  # modules imported on first use are read now, not counted
        "before = rchar()\n"
        "ckpt = open_checkpoint(sys.argv[1])\n"
        "print(rchar() - before, ckpt.tensors['a'].nbytes)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True).stdout
    read, size = map(int, out.split())
    assert size == data.nbytes and read < 64 << 10, f"indexing read {read} bytes"


def _u8(n, start):
    return {"dtype": "U8", "shape": [n], "data_offsets": [start, start + n]}


@pytest.mark.parametrize(
    ("header", "data", "length", "message"),
    [
        ({}, b"", 1000, "runs past the end"),
        ({}, b"", 200_000_000, "above the 100000000-byte cap"),
        (b"[1, 2]", b"", None, "not an object"),
        (b"{nope", b"", None, "not valid JSON"),
        ({"a": {"dtype": "Q8", "shape": [1], "data_offsets": [0, 1]}}, b"x", None, "unknown dtype"),
        ({"a": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}}, b"x", None, "shape"),
        ({"a": {"dtype": "U8", "shape": [1.5], "data_offsets": [0, 1]}}, b"x", None, "shape"),
        ({"a": _u8(4, 0)}, b"xx", None, "truncated"),
        ({"a": _u8(2, 0), "b": _u8(2, 1)}, b"xxx", None, "overlaps"),
        ({"a": _u8(1, 1)}, b"xx", None, "gap"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"xxxx", None, "needs 8 bytes"),
        ({"a": _u8(1, 0)}, b"xx", None, "trailing bytes"),
    ],
)
def test_header_errors(tmp_path, header, data, length, message):
    path = raw_file(tmp_path / "bad.safetensors", header, data, length)
    with pytest.raises(CheckpointError, match=message) as e:
        open_checkpoint(path)
    assert str(path) in str(e.value)


def test_same_tensor_in_two_shards(tmp_path):
    save(tmp_path / "ck" / "a.safetensors", {"x": np.zeros(2, np.float32)})
    save(tmp_path / "ck" / "b.safetensors", {"x": np.zeros(2, np.float32)})
    with pytest.raises(CheckpointError, match="'x' is also in a.safetensors"):
        open_checkpoint(tmp_path / "ck")


def _index(directory, weight_map):
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_weight_map_names_missing_shard(tmp_path):
    save(tmp_path / "a.safetensors", {"x": np.zeros(2)})
    _index(tmp_path, {"x": "a.safetensors", "y": "gone.safetensors"})
    with pytest.raises(CheckpointError, match="gone.safetensors.*does not exist"):
        open_checkpoint(tmp_path)


def test_weight_map_names_tensor_its_shard_lacks(tmp_path):
    save(tmp_path / "a.safetensors", {"x": np.zeros(2)})
    save(tmp_path / "b.safetensors", {"y": np.zeros(2)})
    _index(tmp_path, {"x": "b.safetensors", "y": "b.safetensors"})
    with pytest.raises(CheckpointError, match="puts 'x' in b.safetensors, which does not hold it"):
        open_checkpoint(tmp_path)


def test_shard_tensor_missing_from_weight_map(tmp_path):
    save(tmp_path / "a.safetensors", {"x": np.zeros(2), "z": np.zeros(1)})
    _index(tmp_path, {"x": "a.safetensors"})
    with pytest.raises(CheckpointError, match="missing from weight_map: 'z'"):
        open_checkpoint(tmp_path)


@pytest.mark.parametrize("shard", ["../a.safetensors", "/etc/passwd"])
def test_weight_map_path_escaping_checkpoint(tmp_path, shard):
    (tmp_path / "ck").mkdir()
    save(tmp_path / "a.safetensors", {"x": np.zeros(2)})
    _index(tmp_path / "ck", {"x": shard})
    with pytest.raises(CheckpointError, match="escapes the checkpoint directory"):
        open_checkpoint(tmp_path / "ck")


def test_index_not_json(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text("{")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        open_checkpoint(tmp_path)


def test_missing_path_and_empty_dir(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        open_checkpoint(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="no weights here"):
        open_checkpoint(tmp_path)


def test_weight_map_puts_a_tensor_in_the_wrong_shard(tmp_path):
    save(tmp_path / "a.safetensors", {"x": np.zeros(2)})
    save(tmp_path / "b.safetensors", {"y": np.zeros(2)})
    _index(tmp_path, {"x": "b.safetensors", "y": "a.safetensors"})
    with pytest.raises(CheckpointError, match="weight_map puts 'x' in b.safetensors, but it is in a.safetensors"):
        open_checkpoint(tmp_path)


@pytest.mark.parametrize("frozen", [False, True])
def test_indexing_leaves_the_collector_as_it_was(tmp_path, frozen):
    # open_checkpoint moves its objects to the oldest generation (gc.freeze + unfreeze):
    # the index is there once it returns; a caller's own frozen objects stay frozen, and
    # then the index is left where it was made.
    import gc

    save_sharded(tmp_path, llama_like(), 2)
    open_checkpoint(tmp_path)  # modules imported on first use replace frozen objects of their own
    if frozen:
        gc.freeze()
    count = gc.get_freeze_count()
    try:
        for enabled in (True, False):
            (gc.enable if enabled else gc.disable)()
            tensors = open_checkpoint(tmp_path).tensors
            assert any(o is tensors for o in gc.get_objects(generation=2)) is not frozen
            assert gc.isenabled() is enabled
            # frozen objects may die meanwhile (count drops a little); unfreeze would drop it to 0
            assert (gc.get_freeze_count() > count // 2) if frozen else gc.get_freeze_count() == count
    finally:
        gc.enable()
        gc.unfreeze()
