"""DCP parsers against real checkpoints written by torch's own writers (tests/dcp_fixtures.py)."""

import json
import pickle
import shutil
import struct
import zipfile
import zlib
from io import BytesIO
from pathlib import Path

import numpy as np
import pytest
import torch

from streamck.errors import CheckpointError
from streamck.source.dcp.native import read_distcp
from streamck.source.dcp.sharded import read_sharded_safetensors
from streamck.source.runs import tile_runs

ITEM = {"F32": 4, "BF16": 2, "F16": 2, "I16": 2, "I32": 4, "I64": 8}


@pytest.fixture
def ckpts(dcp_ckpts):
    return dcp_ckpts


def reference_bytes(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """A safetensors file read by hand: name -> (dtype, shape, raw bytes)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    header.pop("__metadata__", None)
    return {k: (v["dtype"], tuple(v["shape"]), data[slice(*v["data_offsets"])]) for k, v in header.items()}


def assemble(entry) -> bytes:
    """The oracle: every tile read with plain file reads, placed with numpy, row-major bytes out."""
    item = ITEM[entry.dtype]
    full = np.zeros((*entry.shape, item), dtype=np.uint8)
    seen = np.zeros(entry.shape, dtype=np.int32)
    for t in entry.tiles:
        n = int(np.prod(t.sizes, dtype=np.int64)) * item
        with open(t.path, "rb") as f:
            f.seek(t.start)
            raw = f.read(n)
        assert len(raw) == n
        box = tuple(slice(o, o + s) for o, s in zip(t.offsets, t.sizes, strict=True))
        full[box] = np.frombuffer(raw, dtype=np.uint8).reshape(*t.sizes, item)
        seen[box] += 1
    assert (seen == 1).all(), entry.name
    return full.tobytes()


def by_runs(entry) -> bytes:
    out = bytearray()
    for r in tile_runs(entry.shape, ITEM[entry.dtype], entry.tiles):
        with open(r.path, "rb") as f:
            f.seek(r.offset)
            out += f.read(r.length)
    return bytes(out)


def parse(ckpts, kind):
    if kind == "dcp":
        return read_distcp(ckpts["dcp"])
    return read_sharded_safetensors(ckpts[kind])


@pytest.mark.parametrize("kind", ["hf", "automodel", "dcp"])
def test_every_tensor_matches_reference(ckpts, kind):
    entries, notices = parse(ckpts, kind)
    ref = reference_bytes(ckpts["reference"])
    assert sorted(entries) == sorted(ref)
    for name, e in entries.items():
        dtype, shape, raw = ref[name]
        assert (e.name, e.dtype, e.shape) == (name, dtype, shape)
        assert e.tiles == tuple(sorted(e.tiles, key=lambda t: t.offsets))
        assert assemble(e) == raw, name
        assert by_runs(e) == raw, name
    # the fixture's in-memory tensors agree with the reference file too
    for name, t in ckpts["tensors"].items():
        assert t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() == ref[name][2]
    if kind == "dcp":
        assert notices == ["step: 1 non-tensor item skipped (step)"]
    else:
        assert notices == []


def test_layouts(ckpts):
    hf, _ = read_sharded_safetensors(ckpts["hf"])
    dcp, _ = read_distcp(ckpts["dcp"])
    auto, _ = read_sharded_safetensors(ckpts["automodel"])
    assert {n: len(e.tiles) for n, e in hf.items()} == {n: len(e.tiles) for n, e in dcp.items()}
    assert hf["model.uneven"].tiles[0].sizes == (501, 3) and hf["model.uneven"].tiles[1].sizes == (500, 3)
    assert [t.offsets for t in dcp["model.cube_bf16"].tiles] == [(0, 0, 0), (0, 3, 0)]
    # .metadata lists names in plan order: rank 0's items, then those only rank 1 saved
    rank0 = [n for n in ckpts["tensors"] if any(t.path.name == "__0_0.distcp" for t in dcp[n].tiles)]
    assert list(dcp) == rank0 + [n for n in ckpts["tensors"] if n not in rank0]
    assert [p.name for p in ckpts["hf"]] == [f"shard-0000{r}-model-00001-of-00001.safetensors" for r in (1, 2)]
    # Automodel's writer stores chunks in plan order, torch's in safetensors' (F32 before BF16)
    assert auto["model.shard1_bf16"].tiles[0].start < auto["model.uneven"].tiles[0].start
    assert hf["model.shard1_bf16"].tiles[0].start > hf["model.uneven"].tiles[0].start
    model_dir = ckpts["automodel_dir"]
    mapping = json.loads((model_dir / ".hf_metadata" / "fqn_to_file_index_mapping.json").read_text())
    assert sorted(mapping) == sorted(auto) and set(mapping.values()) == {1}
    assert (model_dir / ".hf_metadata" / "config.json").is_file()


# ---------------------------------------------------------------- refusals: sharded safetensors


def hf_copy(ckpts, tmp_path, kind="hf") -> list[Path]:
    out = []
    for p in ckpts[kind]:
        shutil.copy(p, tmp_path / p.name)
        out.append(tmp_path / p.name)
    return out


def patch_header(path: Path, old: bytes, new: bytes) -> None:
    assert len(old) == len(new)
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = data[8 : 8 + n]
    assert header.count(old) == 1, (old, header)
    path.write_bytes(data[:8] + header.replace(old, new) + data[8 + n :])


def refused(match, fn, *args):
    with pytest.raises(CheckpointError, match=match) as e:
        fn(*args)
    assert "\n" not in str(e.value)
    return e.value


SHARD0_AT_32 = rb"model.shard0\": {\"saved_offsets\": [32, 0]"


def test_hf_missing_rank_file(ckpts, tmp_path):
    files = hf_copy(ckpts, tmp_path)
    err = refused("rank file shard-00001-.* missing", read_sharded_safetensors, files[1:])
    assert err.path == str(tmp_path)


def test_hf_dtype_disagreement(ckpts, tmp_path):
    files = hf_copy(ckpts, tmp_path)
    patch_header(files[1], b'"model.shard0":{"dtype":"F32"', b'"model.shard0":{"dtype":"I32"')
    err = refused("'model.shard0'.* is I32, the one in shard-00001.* F32", read_sharded_safetensors, files)
    assert err.path == str(files[1])


def test_hf_overlap(ckpts, tmp_path):
    files = hf_copy(ckpts, tmp_path)
    patch_header(files[1], SHARD0_AT_32, SHARD0_AT_32.replace(b"[32", b"[31"))
    refused(r"'model.shard0' \[63, 48\].*overlap", read_sharded_safetensors, files)


def test_hf_gap(ckpts, tmp_path):
    files = hf_copy(ckpts, tmp_path, "automodel")
    patch_header(files[1], SHARD0_AT_32, SHARD0_AT_32.replace(b"[32", b"[33"))
    refused(r"'model.shard0' \[65, 48\].*a gap", read_sharded_safetensors, files)


def test_hf_no_sharding_info(ckpts, tmp_path):
    files = hf_copy(ckpts, tmp_path)
    patch_header(files[0], b'"DCP_SHARDING_INFO"', b'"DCP_SHARDING_INFX"')
    err = refused("no DCP_SHARDING_INFO", read_sharded_safetensors, files)
    assert err.path == str(files[0])


def test_hf_info_and_tensors_disagree(ckpts, tmp_path):
    files = hf_copy(ckpts, tmp_path)
    patch_header(files[0], b'\\"model.vec\\"', b'\\"model.vex\\"')
    refused("'model.vec' has no entry in DCP_SHARDING_INFO", read_sharded_safetensors, files)


def test_hf_unknown_dtype(ckpts, tmp_path):
    files = hf_copy(ckpts, tmp_path)
    patch_header(files[1], b'"extra.w":{"dtype":"F32"', b'"extra.w":{"dtype":"X32"')
    refused("unknown dtype 'X32'", read_sharded_safetensors, files)


# ---------------------------------------------------------------- refusals: native DCP


def dcp_copy(ckpts, tmp_path) -> Path:
    return Path(shutil.copytree(ckpts["dcp"], tmp_path / "dcp"))


def edit_metadata(d: Path, fn) -> None:
    import torch.distributed.checkpoint  # noqa: F401  (the classes pickle.load needs)

    with open(d / ".metadata", "rb") as f:
        md = pickle.load(f)
    fn(md)
    with open(d / ".metadata", "wb") as f:
        pickle.dump(md, f)


def storage_item(md, fqn, offset):
    return next(
        (k, v)
        for k, v in md.storage_data.items()
        if k.fqn == fqn and (None if k.offset is None else tuple(k.offset)) == offset
    )


def blob_of(d: Path, fqn: str, offset: tuple) -> tuple[Path, int, int]:
    import torch.distributed.checkpoint  # noqa: F401

    with open(d / ".metadata", "rb") as f:
        md = pickle.load(f)
    _, info = storage_item(md, fqn, offset)
    return d / info.relative_path, info.offset, info.length


def patch_blob(d: Path, fqn: str, offset: tuple, record: str, edit) -> None:
    """Rewrite the blob's central-directory entry for ``record`` and/or its content.

    ``edit(content, central_entry) -> (content, central_entry)``; the CRC is refreshed.
    """
    path, start, length = blob_of(d, fqn, offset)
    data = bytearray(path.read_bytes())
    blob = bytes(data[start : start + length])
    z = zipfile.ZipFile(BytesIO(blob))
    info = next(i for i in z.infolist() if i.filename.endswith(record))
    local = blob[info.header_offset : info.header_offset + 30]
    nl, el = struct.unpack("<HH", local[26:30])
    body = info.header_offset + 30 + nl + el
    content = blob[body : body + info.file_size]
    name = info.filename.encode()
    cd = blob.index(b"PK\x01\x02")
    while blob[cd + 46 : cd + 46 + len(name)] != name:
        cd = blob.index(b"PK\x01\x02", cd + 4)
    entry = bytearray(blob[cd : cd + 46])
    new_content, entry = edit(content, entry)
    assert len(new_content) == len(content)
    entry[16:20] = struct.pack("<I", zlib.crc32(new_content))
    data[start + body : start + body + len(content)] = new_content
    data[start + cd : start + cd + 46] = entry
    path.write_bytes(bytes(data))


def test_dcp_missing_metadata(ckpts, tmp_path):
    d = dcp_copy(ckpts, tmp_path)
    (d / ".metadata").unlink()
    err = refused(r"\*.distcp files, but no .metadata: .*`cp dir/\*` leaves it behind", read_distcp, d)
    assert err.path == str(d)


def test_dcp_missing_rank_file(ckpts, tmp_path):
    d = dcp_copy(ckpts, tmp_path)
    (d / "__1_0.distcp").unlink()
    err = refused("file named by .metadata is missing", read_distcp, d)
    assert err.path == str(d / "__1_0.distcp")


def test_dcp_gap(ckpts, tmp_path):
    d = dcp_copy(ckpts, tmp_path)
    edit_metadata(d, lambda md: md.state_dict_metadata["model.uneven"].chunks.pop())
    refused(r"'model.uneven' \[1001, 3\]: blocks hold 1503 elements.*a gap", read_distcp, d)


def test_dcp_two_chunks_in_one_file(ckpts, tmp_path):
    d = dcp_copy(ckpts, tmp_path)

    def edit(md):
        _, first = storage_item(md, "model.shard0", (0, 0))
        key, _ = storage_item(md, "model.shard0", (32, 0))
        md.storage_data[key] = first

    edit_metadata(d, edit)
    refused(r"the chunks 'model.shard0' \[0, 0\] and 'model.shard0' \[32, 0\] share bytes \[0, \d+\)", read_distcp, d)


def test_dcp_unknown_dtype(ckpts, tmp_path):
    import torch

    d = dcp_copy(ckpts, tmp_path)
    edit_metadata(d, lambda md: setattr(md.state_dict_metadata["extra.w"].properties, "dtype", torch.complex128))
    refused("'extra.w': unknown or unsupported dtype torch.complex128", read_distcp, d)


def test_dcp_transform_descriptors(ckpts, tmp_path):
    d = dcp_copy(ckpts, tmp_path)
    edit_metadata(d, lambda md: setattr(storage_item(md, "model.vec", (19,))[1], "transform_descriptors", ["zstd"]))
    refused(r"tensor 'model.vec' is stored through transforms \['zstd'\]", read_distcp, d)


def test_dcp_dtype_disagreement(ckpts, tmp_path):
    d = dcp_copy(ckpts, tmp_path)
    patch_blob(d, "model.shard0", (32, 0), "data.pkl", lambda c, e: (c.replace(b"FloatStorage", b"ShortStorage"), e))
    err = refused(r"'model.shard0' chunk at \[32, 0\]: blob holds I16, .metadata says F32", read_distcp, d)
    assert err.path == str(d / "__1_0.distcp")


def test_dcp_not_contiguous(ckpts, tmp_path):
    d = dcp_copy(ckpts, tmp_path)
    strides = b"K0K\x01\x86"  # BININT1 48, BININT1 1, TUPLE2

    def edit(c, e):
        assert c.count(strides) == 1
        return c.replace(strides, b"K\x01K " + b"\x86"), e  # strides (1, 32): a transposed view

    patch_blob(d, "model.shard0", (0, 0), "data.pkl", edit)
    refused(r"chunk at \[0, 0\]: a strided view \(strides \[1, 32\]\) among several chunks", read_distcp, d)


def test_dcp_big_endian(ckpts, tmp_path):
    d = dcp_copy(ckpts, tmp_path)
    patch_blob(d, "model.vec", (0,), "byteorder", lambda c, e: (b"big   ", e))
    refused(r"'model.vec' chunk at \[0\]: blob at byte \d+: byte order 'big' is not supported", read_distcp, d)


def test_dcp_compressed(ckpts, tmp_path):
    d = dcp_copy(ckpts, tmp_path)

    def edit(c, e):
        e[10:12] = struct.pack("<H", zipfile.ZIP_DEFLATED)
        return c, e

    patch_blob(d, "model.cube_bf16", (0, 3, 0), "data/0", edit)
    refused(r"'model.cube_bf16' chunk at \[0, 3, 0\]: .*storage record data/0 is compressed", read_distcp, d)


def test_dcp_short_storage(ckpts, tmp_path):
    d = dcp_copy(ckpts, tmp_path)

    def edit(c, e):
        e[20:28] = struct.pack("<II", 16, 16)  # the record claims 16 bytes, the chunk needs 120
        return c, e

    patch_blob(d, "model.cube_bf16", (0, 0, 0), "data/0", edit)
    refused(r"chunk at \[0, 0, 0\]: view runs past its 16-byte storage", read_distcp, d)


def test_dcp_shape_disagreement(ckpts, tmp_path):
    d = dcp_copy(ckpts, tmp_path)
    size = b"K K0\x86"  # (32, 48) in data.pkl

    def edit(c, e):
        assert c.count(size) == 1
        return c.replace(size, b"K K/\x86"), e

    patch_blob(d, "model.shard0", (0, 0), "data.pkl", edit)
    refused(r"blob holds shape \[32, 47\], .metadata says \[32, 48\]", read_distcp, d)


def test_dcp_hostile_metadata(ckpts, tmp_path):
    d = dcp_copy(ckpts, tmp_path)
    payload = b"\x80\x04cos\nsystem\n\x8c\x04true\x85R."
    (d / ".metadata").write_bytes(payload)
    refused("refusing to load os.system", read_distcp, d)


def test_dcp_step_blob_never_unpickled(ckpts, tmp_path):
    d = dcp_copy(ckpts, tmp_path)
    path, start, length = blob_of(d, "step", None)
    data = bytearray(path.read_bytes())
    data[start : start + length] = b"\xff" * length  # whatever the bytes item holds, it is not read
    path.write_bytes(bytes(data))
    entries, notices = read_distcp(d)
    assert "step" not in entries and notices == ["step: 1 non-tensor item skipped (step)"]


def test_dcp_encrypted_storage_record(ckpts, tmp_path):
    # the blob's storage record is located by torchzip's one reader, with its encryption check
    d = dcp_copy(ckpts, tmp_path)

    def edit(c, e):
        e[8] |= 1  # general purpose flag bit 0: encrypted
        return c, e

    patch_blob(d, "model.vec", (19,), "data/0", edit)
    refused(r"'model.vec' chunk at \[19\]: .*archive record .*data/0 is encrypted", read_distcp, d)
