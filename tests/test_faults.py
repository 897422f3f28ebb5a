"""Faults really induced: size limits, signals at a known point, kills, races, changing sources."""

import os
import resource
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import numpy as np
import pytest
from helpers import llama_like, read_all, save, save_sharded

from streamck import CheckpointError, OutputError, Rules, compile_plan, open_checkpoint, write_plan
from streamck.cli import main

# Run the CLI in a child whose first tensor copy announces itself (a file appears)
# and then waits: the parent acts at that known point, mid-write, temp file open.
PAUSING_CHILD = """
import os, sys, time
from streamck.source.reader import Reader
real = Reader.copy
def paused(self, *a, **k):
    if not os.path.exists(sys.argv[1]):
        open(sys.argv[1], "w").close()
        time.sleep(float(sys.argv[2]))
    return real(self, *a, **k)
Reader.copy = paused
from streamck.cli import main
sys.exit(main(sys.argv[3:]))
"""


def start_paused(ready, pause, *args):
    return subprocess.Popen(
        [sys.executable, "-c", PAUSING_CHILD, str(ready), str(pause), *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(path, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"child never reached the pause point ({path})"
        time.sleep(0.01)


def leftovers(directory):
    return sorted(p.name for p in directory.iterdir() if "streamck" in p.name)


@pytest.fixture
def source(tmp_path):
    return save_sharded(tmp_path / "src", llama_like(layers=4), 2)


def snapshot(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
@pytest.mark.parametrize("target", ["out", "out.safetensors"])
def test_signal_mid_write_leaves_nothing(tmp_path, source, sig, code, target):
    before = snapshot(source)
    out = tmp_path / target
    child = start_paused(tmp_path / "ready", 30, "rewrite", source, "-o", out, "--strip-prefix", "model.")
    wait_for(tmp_path / "ready")
    assert leftovers(tmp_path), "the temporary output should exist mid-write"
    child.send_signal(sig)
    _, err = child.communicate(timeout=30)
    assert child.returncode == code, err
    assert "Traceback" not in err and err.count("\n") == 1
    assert not out.exists() and leftovers(tmp_path) == []
    assert snapshot(source) == before


def test_sigkill_leaves_a_recognisable_temp_that_the_next_run_removes(tmp_path, source):
    out = tmp_path / "out"
    child = start_paused(tmp_path / "ready", 30, "rewrite", source, "-o", out)
    wait_for(tmp_path / "ready")
    child.kill()
    child.communicate(timeout=30)
    assert not out.exists()
    (stale,) = leftovers(tmp_path)
    assert stale.startswith(".out.streamck-tmp-")
    assert main(["rewrite", str(source), "-o", str(tmp_path / "other.safetensors"), "-q"]) == 0
    assert leftovers(tmp_path) == []
    assert not out.exists()


def test_live_runs_temp_is_not_removed_by_another_run(tmp_path, source):
    child = start_paused(tmp_path / "ready", 3, "rewrite", source, "-o", tmp_path / "a", "-q")
    wait_for(tmp_path / "ready")
    assert main(["rewrite", str(source), "-o", str(tmp_path / "b"), "-q"]) == 0
    child.communicate(timeout=30)
    assert child.returncode == 0  # its temp survived the other run's cleanup
    assert (
        read_all(tmp_path / "a" / "model.safetensors").keys() == read_all(tmp_path / "b" / "model.safetensors").keys()
    )


@pytest.mark.parametrize("target", ["out", "out.safetensors"])
def test_file_size_limit_mid_write(tmp_path, source, target):
    before = snapshot(source)
    out = tmp_path / target

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))

    proc = subprocess.run(
        [sys.executable, "-m", "streamck", "rewrite", str(source), "-o", str(out)],
        capture_output=True,
        text=True,
        preexec_fn=limit,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "File too large" in proc.stderr
    assert not out.exists() and leftovers(tmp_path) == []
    assert snapshot(source) == before


@pytest.mark.parametrize("target", ["out", "out.safetensors"])
@pytest.mark.parametrize("force", [False, True])
def test_racing_rewrites_give_one_complete_output(tmp_path, source, target, force):
    out = tmp_path / target
    extra = ["--force"] if force else []
    a = start_paused(tmp_path / "ready-a", 1.0, "rewrite", source, "-o", out, "-q", *extra)
    b = start_paused(tmp_path / "ready-b", 1.0, "rewrite", source, "-o", out, "-q", "--strip-prefix", "model.", *extra)
    results = [p.communicate(timeout=60) for p in (a, b)]
    codes = sorted((a.returncode, b.returncode))
    assert codes == ([0, 0] if force else [0, 2]), results
    if not force:
        loser = results[[a.returncode, b.returncode].index(2)][1]
        assert "appeared while writing" in loser or "already exists" in loser
    got = read_all(out if out.suffix else out / "model.safetensors")
    src = llama_like(layers=4)
    assert sorted(got) in (sorted(src), sorted(k.removeprefix("model.") for k in src))
    assert leftovers(tmp_path) == []


def test_source_changing_during_rewrite_is_detected(tmp_path, source, monkeypatch):
    from streamck.source.reader import Reader

    real = Reader.copy
    shard = next(source.glob("*.safetensors"))

    def touching(self, *a, **k):
        os.utime(shard, ns=(0, 0))  # a real change of the source's mtime, mid-write
        return real(self, *a, **k)

    monkeypatch.setattr(Reader, "copy", touching)
    plan = compile_plan(open_checkpoint(source))
    with pytest.raises(CheckpointError, match="changed during the run"):
        write_plan(plan, tmp_path / "out")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_source_truncated_during_rewrite(tmp_path):
    src = save(tmp_path / "s.safetensors", {"a": np.ones(1000, np.float32)})
    plan = compile_plan(open_checkpoint(src), Rules())
    with open(src, "r+b") as f:
        f.truncate(src.stat().st_size - 100)
    with pytest.raises(CheckpointError, match="ended before|changed"):
        write_plan(plan, tmp_path / "o.safetensors")
    assert not (tmp_path / "o.safetensors").exists()


@contextmanager
def unprivileged():
    """Run as nobody (effective uid only, so root can come back), or as we are if not root."""
    if os.geteuid() != 0:
        yield
        return
    os.setegid(65534)
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


@pytest.fixture
def open_dir():
    """A directory every user can enter (pytest's tmp_path sits under a root-only one)."""
    import shutil
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp(prefix="streamck-perm-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def test_unreadable_source(open_dir, capsys):
    src = save(open_dir / "s.safetensors", {"a": np.ones(2)})
    src.chmod(0)
    with unprivileged():
        code = main(["ls", str(src)])
    err = capsys.readouterr().err
    assert code == 2 and err == f"streamck: error: {src}: cannot read: Permission denied\n", err


def test_unwritable_output_dir(open_dir, capsys):
    src = save(open_dir / "s.safetensors", {"a": np.ones(2)})
    src.chmod(0o644)
    (open_dir / "ro").mkdir(mode=0o555)
    with unprivileged():
        code = main(["rewrite", str(src), "-o", str(open_dir / "ro" / "o.safetensors"), "-q"])
    err = capsys.readouterr().err
    assert code == 2 and "ro: cannot write here: Permission denied" in err and err.count("\n") == 1, err
    assert list((open_dir / "ro").iterdir()) == []


def test_path_we_cannot_enter(tmp_path, capsys):
    src = save(tmp_path / "s.safetensors", {"a": np.ones(2)})
    tmp_path.chmod(0o700)
    with unprivileged():
        code = main(["ls", str(src)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("streamck: error: ") and "Permission denied" in err, err


def test_output_refusals_from_the_cli(tmp_path, source, capsys):
    with pytest.raises(OutputError):
        write_plan(compile_plan(open_checkpoint(source)), source, force=True)
    assert main(["rewrite", str(source), "-o", str(source), "--force"]) == 2
    assert "refusing to write over the source" in capsys.readouterr().err
