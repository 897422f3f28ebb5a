"""torch.save archives as output: streamed like safetensors, loadable by torch.load (weights
only, and mmap), every tensor equal, sharded with an index like save_pretrained."""

import json
import zipfile

import pytest
import torch
from helpers import cli, llama_like, save_sharded

import streamck
from streamck import OutputError, UsageError


@pytest.fixture
def state():
    torch.manual_seed(0)
    base = torch.randn(6, 10)
    return {
        "plain": torch.randn(3, 5),
        "transposed": base.t(),  # a view: gathered into row-major order
        "bf16": torch.randn(4, 3).bfloat16(),
        "long": torch.arange(7),
        "flag": torch.tensor([True, False]),
        "f8": torch.randn(5).to(torch.float8_e4m3fn),
        "u16": torch.arange(3).to(torch.uint16),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    raw = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731  bits, NaNs and float8 alike
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw(a), raw(b))


@pytest.mark.parametrize("name", ["model.pth", "pytorch_model.bin", "m.pt"])
def test_single_archive_loads_with_torch(tmp_path, state, name):
    torch.save(state, tmp_path / "src.bin")
    streamck.rewrite(tmp_path / "src.bin", tmp_path / name, verify=True)
    for mmap in (False, True):
        got = torch.load(tmp_path / name, weights_only=True, mmap=mmap)
        assert list(got) == sorted(state) and all(same(got[k], state[k]) for k in state)
    assert zipfile.ZipFile(tmp_path / name).testzip() is None  # every CRC-32 right
    info = zipfile.ZipFile(tmp_path / name).getinfo(f"{name.rsplit('.', 1)[0]}/data/0")
    with open(tmp_path / name, "rb") as f:
        f.seek(info.header_offset + 26)
        n, extra = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
    assert (info.header_offset + 30 + n + extra) % 64 == 0  # data aligned as torch aligns it


def test_sharded_bin_with_index_and_cast(tmp_path):
    src = save_sharded(tmp_path / "src", llama_like(layers=3), 2)
    r = cli(
        "rewrite",
        src,
        "-o",
        tmp_path / "out",
        "--format",
        "torch",
        "--max-shard-size",
        "600B",
        "--dtype",
        "bf16",
        "--verify",
        "-q",
    )
    assert r.returncode == 0, r.stderr
    index = json.loads((tmp_path / "out" / "pytorch_model.bin.index.json").read_text())
    files = sorted(p.name for p in (tmp_path / "out").glob("pytorch_model-*.bin"))
    assert len(files) > 2 and sorted(set(index["weight_map"].values())) == files
    got = {}
    for f in files:
        got.update(torch.load(tmp_path / "out" / f, weights_only=True))
    want = {k: torch.from_numpy(v) for k, v in llama_like(layers=3).items()}
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert same(got[k], v.to(torch.bfloat16) if v.is_floating_point() else v), k


def test_refusals(tmp_path, state):
    torch.save(state, tmp_path / "src.bin")
    with pytest.raises(UsageError, match="disagrees"):
        streamck.rewrite(tmp_path / "src.bin", tmp_path / "o.safetensors", format="torch")
    with pytest.raises(OutputError, match="needs a directory"):
        streamck.rewrite(tmp_path / "src.bin", tmp_path / "o.pth", max_shard_size=100)
    r = cli("rewrite", tmp_path / "src.bin", "-o", "-", "--format", "torch")
    assert r.returncode == 2 and "torch archive to a path" in r.stderr


def test_verify_catches_a_corrupted_tensor(tmp_path, state, monkeypatch):
    from streamck.writer.shardwriter import ShardWriter

    real = ShardWriter.pieces

    def corrupt(self, t):
        for piece in real(self, t):
            if t.name == "plain":
                piece = bytearray(piece)
                piece[3] ^= 1
            yield piece

    monkeypatch.setattr(ShardWriter, "pieces", corrupt)
    torch.save(state, tmp_path / "src.bin")
    with pytest.raises(OutputError, match="verification failed: plain"):
        streamck.rewrite(tmp_path / "src.bin", tmp_path / "o.pth", verify=True)
    assert not (tmp_path / "o.pth").exists()
