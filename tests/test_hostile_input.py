"""Issue #55, second pass at hostile input: memory and time bounded whatever a file claims,
never a secret read through a link, and remote servers that misbehave said in one line.

Every file is crafted here, in a temp dir; every server listens on 127.0.0.1 only. The CLI runs
in a child under an address-space limit and a timeout, so that what used to crash, hang or
allocate gigabytes fails the test instead of the machine."""

from __future__ import annotations

import io
import resource
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import REPO

LIMIT = 1 << 30  # address space for the child: the old code's allocations (4 GiB, 2 GiB…) fail under it


def run(*args, limit: int = LIMIT, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m streamck ARGS`` in a child held to ``limit`` bytes of address space; a child
    still running after ``timeout`` seconds is killed, and the test fails on it."""

    def held():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    cmd = [sys.executable, "-m", "streamck", *map(str, args)]
    try:
        return subprocess.run(
            cmd, capture_output=True, text=True, preexec_fn=held, timeout=timeout, env={"PYTHONPATH": str(REPO)}
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"streamck {' '.join(map(str, args))} still running after {timeout} s")


def one_line(proc: subprocess.CompletedProcess, path: Path, message: str) -> None:
    """Exit 2 and one line on stderr naming ``path`` and saying ``message``: no traceback, no crash."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert proc.stderr.startswith(f"streamck: error: {path}"), proc.stderr
    assert message in proc.stderr, proc.stderr


def torch_zip(path: Path, pkl: bytes, compress: int = zipfile.ZIP_STORED) -> Path:
    """A torch-like archive whose data.pkl is ``pkl`` and whose storage 0 holds 8 bytes."""
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", pkl, compress_type=compress)
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/data/0", bytes(8))
    return path


def _g(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _int(n: int) -> bytes:  # LONG1: any int
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


_STORAGE = b"(X\x07\x00\x00\x00storage" + _g("torch", "FloatStorage") + b"X\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x02tQ"
_W = b"\x80\x02}X\x01\x00\x00\x00w"  # an empty dict, then the key 'w'


def _tensor(size: int, stride: int) -> bytes:
    return (
        _g("torch._utils", "_rebuild_tensor_v2")
        + b"("
        + _STORAGE
        + b"K\x00"
        + _int(size)
        + b"\x85"
        + _int(stride)
        + b"\x85tR"
    )


# --- 5. pickles: depth, memo, object count, flattened size, inflated size ------------------


def test_a_deep_tuple_as_a_dict_key_is_refused_not_a_crash(tmp_path):
    """Hashing a tuple nested 300,000 deep recursed in C until the process died (exit -11)."""
    path = torch_zip(tmp_path / "deep.bin", b"\x80\x02})" + b"\x85" * 300_000 + b"K\x01s.")
    one_line(run("ls", path), path, "tuples nested more than 100 deep")


def test_a_deep_persistent_id_is_one_line(tmp_path):
    """The refusal quoted the id with repr(), which raised RecursionError on a list 100,000 deep."""
    n = 100_000
    path = torch_zip(tmp_path / "pid.bin", _W + b"]" * n + b"a" * (n - 1) + b"Qs.")
    one_line(run("ls", path), path, "data.pkl refused: unexpected persistent id [[[[")


def test_a_memo_index_far_past_the_pickle_allocates_nothing(tmp_path):
    """LONG_BINPUT 2**28 in a few bytes: the unpickler sized its memo for it (4 GiB)."""
    path = torch_zip(tmp_path / "memo.bin", _W + b"K\x01r\x00\x00\x00\x10s.")
    one_line(run("ls", path), path, "memo index 268435456 in a pickle of")


def test_shared_lists_do_not_flatten_into_billions(tmp_path):
    """Ten references to one list, nine levels deep: a billion entries once flattened."""
    pkl = _W + b"]q\x000"  # memo 0: the empty list at the bottom (popped: only the top one stays)
    for level in range(1, 10):
        pkl += b"(" + (b"h" + bytes([level - 1])) * 10 + b"lq" + bytes([level]) + (b"0" if level < 9 else b"")
    path = torch_zip(tmp_path / "laughs.bin", pkl + b"s.")
    one_line(run("ls", path, timeout=60), path, "more than 8388608 entries once nested containers are flattened")


def test_a_small_deflated_pickle_of_millions_of_objects_is_refused(tmp_path):
    """30 million empty lists deflate to a few tens of KiB and took 2 GiB to build."""
    pkl = _W + b"(" + b"]" * 30_000_000 + b"ls."
    path = torch_zip(tmp_path / "many.bin", pkl, zipfile.ZIP_DEFLATED)
    assert path.stat().st_size < 100_000
    one_line(run("ls", path), path, "more than 16777216 opcodes (objects) to build")


def _lying_record(path: Path, name: str, real: int, claimed: bytes) -> None:
    """Deflate ``real`` bytes (``claimed`` and zeros) as record ``name``, and have both its headers
    say it inflates to ``len(claimed)`` bytes."""
    with zipfile.ZipFile(path, "a", zipfile.ZIP_DEFLATED) as z, z.open(name, "w", force_zip64=False) as f:
        f.write(claimed)
        block = bytes(1 << 20)
        for _ in range((real - len(claimed)) >> 20):
            f.write(block)
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as z:
        info = z.getinfo(name)
    data[info.header_offset + 22 : info.header_offset + 26] = len(claimed).to_bytes(4, "little")
    end = data.rfind(b"PK\x05\x06")
    central = int.from_bytes(data[end + 16 : end + 20], "little")  # where the central directory starts
    while data[central : central + 4] == b"PK\x01\x02":  # its entry for ``name``
        n = int.from_bytes(data[central + 28 : central + 30], "little")
        if data[central + 46 : central + 46 + n] == name.encode():
            data[central + 24 : central + 28] = len(claimed).to_bytes(4, "little")
        m, k = (int.from_bytes(data[central + i : central + i + 2], "little") for i in (30, 32))
        central += 46 + n + m + k
    path.write_bytes(bytes(data))


def test_a_record_inflating_past_its_size_is_read_to_its_size(tmp_path):
    """A byteorder record of 6 bytes by its headers that inflates to 640 MiB: zipfile's read()
    inflated it whole before cutting it to 6 (held in memory: a MemoryError under 512 MiB)."""
    path = tmp_path / "inflate.bin"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", _W + _tensor(2, 1) + b"s.")
        z.writestr("archive/data/0", bytes(8))
    _lying_record(path, "archive/byteorder", 640 << 20, b"little")
    assert path.stat().st_size < 2 << 20
    one_line(run("ls", path, limit=512 << 20), path, "byteorder: Bad CRC-32")


# --- 6. sizes that lie -----------------------------------------------------------------


def test_an_overlapping_view_claiming_2_80_elements_is_refused(tmp_path):
    """A stride-0 view of 2**80 elements over 8 bytes was listed as 4.8e24 bytes, and rewritten for ever."""
    path = torch_zip(tmp_path / "expand.bin", _W + _tensor(1 << 80, 0) + b"s.")
    one_line(run("ls", path), path, "its elements overlap")
    ok = torch_zip(tmp_path / "small.bin", _W + _tensor(64, 0) + b"s.")  # a small expanded tensor still reads
    proc = run("ls", ok)
    assert proc.returncode == 0 and "w" in proc.stdout, proc.stderr


@pytest.mark.parametrize("count", [10**9, 1 << 40])
def test_a_zero_partition_count_past_its_files_is_one_line(tmp_path, count):
    """partition_count 2**40 with one rank file: a list of every missing rank (MemoryError, or a kill)."""
    torch = pytest.importorskip("torch")
    step = tmp_path / "global_step1"
    step.mkdir()
    osd = {"zero_stage": 2, "partition_count": count, "single_partition_of_fp32_groups": [torch.zeros(4)]}
    torch.save({"optimizer_state_dict": osd}, step / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    torch.save({"module": {"w": torch.zeros(4)}}, step / "mp_rank_00_model_states.pt")
    one_line(run("ls", step, timeout=60), step, f"for rank 1, 2, 3, 4, 5, 6, 7, 8, … ({count - 1} in all) missing")


def test_dcp_storage_records_of_no_bytes_are_refused_before_any_is_read(tmp_path):
    """A .metadata naming chunks of 0 bytes: they share no bytes, so nothing bounded how many it named."""
    torch = pytest.importorskip("torch")
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    n = 1000
    chunks = [ChunkStorageMetadata(offsets=torch.Size([i, 0]), sizes=torch.Size([1, 4])) for i in range(n)]
    meta = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([n, 4]), chunks)
    where = {MetadataIndex("w", torch.Size([i, 0])): _StorageInfo("__0_0.distcp", 0, 0) for i in range(n)}
    d = tmp_path / "dcp"
    d.mkdir()
    (d / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={"w": meta}, storage_data=where)))
    (d / "__0_0.distcp").write_bytes(b"")
    one_line(run("ls", d), d / ".metadata", "'w': a 0-byte storage record, shorter than any archive")


def test_the_pickle_walk_leaves_real_pickles_alone():
    """What a real torch.save and DCP pickle hold passes the walk: every opcode, nested dicts,
    protocol 2 and 4, memo indices past 2**16."""
    torch = pytest.importorskip("torch")
    import pickle

    from streamck.source.torchzip import bounds

    sd = {f"layers.{i}.w": torch.zeros(2, 3) for i in range(10_000)}
    sd["nested"] = {"a": [torch.ones(1), (1, 2.5, "x", None, True)], "b": {"c": b"bytes", (1, (2, (3,))): 4}}
    for protocol in (0, 2, 4, 5):
        buf = io.BytesIO()
        torch.save(sd, buf, pickle_protocol=protocol)
        with zipfile.ZipFile(buf) as z:
            data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
        bounds.check(data)
        bounds.check(pickle.dumps({"k": [(i, (i,)) for i in range(70_000)]}, protocol=protocol))
    deep = pickle.dumps({((((((1,),),),),),): 1})
    bounds.check(deep)
    with pytest.raises(bounds.PickleBoundsError, match="tuples nested more than 100 deep"):
        bounds.check(b"\x80\x02)" + b"\x85" * 100 + b".")
    bounds.check(b"\x80\x02)" + b"\x85" * 99 + b".")


# --- 4. secrets: links out of the checkpoint are never followed ------------------------


def _model(directory: Path) -> Path:
    import numpy as np
    from helpers import save

    save(directory / "model.safetensors", {"w": np.arange(4, dtype=np.float32)})
    (directory / "config.json").write_text('{"model_type": "llama"}')
    return directory


def test_a_side_file_linked_out_of_the_checkpoint_is_not_copied(tmp_path):
    """README.md -> /proc/self/environ was copied into the output with the process's keys in it."""
    src = _model(tmp_path / "src")
    (tmp_path / "secret.txt").write_text("AWS_SECRET_ACCESS_KEY=hunter2")
    (src / "README.md").symlink_to("/proc/self/environ")
    (src / "tokenizer.json").symlink_to(tmp_path / "secret.txt")
    (src / "vocab.txt").write_text("a\nb\n")
    (src / "merges.txt").symlink_to("vocab.txt")  # a link inside the checkpoint is followed as before
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "streamck", "rewrite", src, "-o", out],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(REPO), "AWS_SECRET_ACCESS_KEY": "hunter2"},
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "merges.txt", "model.safetensors", "vocab.txt"]
    assert not any("hunter2" in p.read_text(errors="replace") for p in out.iterdir() if p.suffix != ".safetensors")
    assert "not copied, links out of the checkpoint: README.md, tokenizer.json" in proc.stderr


def test_an_index_naming_a_shard_linked_out_is_refused(tmp_path):
    src = _model(tmp_path / "src")
    (src / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    (src / "model.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    (src / "model.safetensors.index.json").write_text('{"weight_map": {"w": "model.safetensors"}}')
    proc = run("ls", src)
    one_line(proc, src / "model.safetensors.index.json", "shard 'model.safetensors' is a link out of the checkpoint")
    (src / "model.safetensors").unlink()
    (src / "model.safetensors").symlink_to("/proc/self/environ")
    one_line(run("ls", src), src / "model.safetensors.index.json", "is a link out of the checkpoint directory")


# --- 7 and 9. remote servers: http(s):// read; a server that ignores Range said so ----------


def _remote_env(server) -> dict[str, str]:
    return {
        "PYTHONPATH": str(REPO),
        "AWS_ACCESS_KEY_ID": "k",
        "AWS_SECRET_ACCESS_KEY": "s",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": server.url,
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": "/nonexistent",
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
        "NO_PROXY": "127.0.0.1",
        "no_proxy": "127.0.0.1",
    }


def _remote(server, *args) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "streamck", *map(str, args)]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_remote_env(server))
    except subprocess.TimeoutExpired:
        pytest.fail(f"streamck {' '.join(map(str, args))} still running after 120 s")


@pytest.fixture
def served(tmp_path):
    """A bucket folder holding a model of one 64 MiB tensor and its config, served two ways."""
    import numpy as np
    from helpers import save

    pytest.importorskip("fsspec")
    root = tmp_path / "www"
    save(root / "b" / "ck" / "model.safetensors", {"w": np.zeros(16 << 20, np.float32)})
    (root / "b" / "ck" / "config.json").write_text('{"model_type": "llama"}')
    return root


def test_http_urls_are_read(tmp_path, served):
    """fsspec's HTTP filesystem was handed the URL without its scheme: "no such file"."""
    import range_server

    pytest.importorskip("aiohttp")
    with range_server.serving(served) as server:
        url = f"{server.url}/b/ck"
        proc = _remote(server, "ls", f"{url}/model.safetensors")
        assert proc.returncode == 0 and "w" in proc.stdout, proc.stderr
        assert server.sent < 1 << 20, server.sent  # the header, by ranges
        proc = _remote(server, "rewrite", url, "-o", tmp_path / "out", "-q")
        assert proc.returncode == 0, proc.stderr
    local = subprocess.run(
        [sys.executable, "-m", "streamck", "rewrite", served / "b" / "ck", "-o", tmp_path / "local", "-q"],
        capture_output=True,
        timeout=120,
        env={"PYTHONPATH": str(REPO)},
    )
    assert local.returncode == 0
    got, want = (sorted((p.name, p.read_bytes()) for p in (tmp_path / d).iterdir()) for d in ("out", "local"))
    assert got == want


@pytest.mark.parametrize("scheme", ["http", "s3"])
def test_a_server_that_ignores_ranges_is_said_so_not_read_whole(served, scheme):
    """It answered an 8-byte header read with all 64 MiB: fetched and held, then "truncated"."""
    import range_server

    pytest.importorskip("s3fs" if scheme == "s3" else "aiohttp")
    with range_server.serving(served, ranges=False) as server:
        url = f"{server.url}/b/ck/model.safetensors" if scheme == "http" else "s3://b/ck/model.safetensors"
        proc = _remote(server, "ls", url)
        sent = server.sent
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"streamck: error: {url}: the server ignores Range requests"), proc.stderr
    assert sent < 16 << 20, sent  # what socket buffers took before the client let go, not the file
