"""Issue #12: nothing of the user's is lost: not files beside an output, not an exit status
through a pipe, not a live run's temporary, not a tensor nested in a torch pickle."""

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import cli, llama_like, read_all, save, save_sharded
from safetensors.torch import load_file

import streamck
from streamck import CheckpointError, OutputError, compile_plan, open_checkpoint, write_plan
from streamck.writer import atomic
from streamck.writer.atomic import remove_stale

REPO = Path(streamck.__file__).resolve().parents[1]


def leftovers(directory):
    return sorted(p.name for p in directory.iterdir() if "streamck" in p.name)


@pytest.fixture
def source(tmp_path):
    src = save_sharded(tmp_path / "src", llama_like(), 2)
    (src / "config.json").write_text('{"model_type": "llama"}')
    return src


# 1. --force replaces an earlier export, never what the user keeps beside it.


def test_force_writes_into_a_directory_and_keeps_the_other_files(tmp_path, source):
    """As save_pretrained does (#54): the model goes in, an earlier export's weights go out,
    the user's notes, other models and other weights files stay."""
    models = tmp_path / "models"
    (models / "other_model").mkdir(parents=True)
    (models / "other_model" / "model.safetensors").write_bytes(b"keep")
    (models / "NOTES.md").write_text("mine")
    (models / "adapter_model.safetensors").write_bytes(b"also mine")
    (models / "model.safetensors").write_bytes(b"old")
    save_sharded(models, {"old.weight": np.ones(3, np.float32)}, 2)  # an earlier sharded export and its index
    proc = cli("rewrite", source, "-o", models, "-q")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "already exists; pass --force to write into it" in proc.stderr and "other files are kept" in proc.stderr
    assert (models / "model.safetensors").read_bytes() == b"old"
    proc = cli("rewrite", source, "-o", models, "--force", "-q")
    assert proc.returncode == 0, proc.stderr
    assert (models / "NOTES.md").read_text() == "mine"
    assert (models / "other_model" / "model.safetensors").read_bytes() == b"keep"
    assert (models / "adapter_model.safetensors").read_bytes() == b"also mine"
    assert read_all(models / "model.safetensors").keys() == llama_like().keys()
    kept = ["NOTES.md", "adapter_model.safetensors", "config.json", "model.safetensors", "other_model"]
    assert sorted(p.name for p in models.iterdir()) == kept  # the old shards and their index are gone
    assert leftovers(tmp_path) == []


def test_force_replaces_an_earlier_export_in_its_directory(tmp_path, source):
    models = tmp_path / "models"
    save_sharded(models, {"old.weight": np.ones(3, np.float32)}, 3)  # shards and index
    (models / "pytorch_model.bin").write_bytes(b"stale")
    (models / "config.json").write_text("{}")
    inode = models.stat().st_ino
    proc = cli("rewrite", source, "-o", models, "--force", "-q")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in models.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(read_all(models / "model.safetensors")) == sorted(llama_like())
    assert (models / "config.json").read_text() == '{"model_type": "llama"}'
    assert models.stat().st_ino == inode  # the same directory: new files moved in, stale ones removed
    assert leftovers(tmp_path) == []


def test_force_replaces_a_folder_the_output_writes_whole(tmp_path, source):
    """A folder of the output (a sentence-transformers module; a Megatron run's iter_0000000/)
    is the new one after --force, not the old one with the new files moved in (#52's review:
    stale .distcp files were left beside the new ones)."""
    (source / "modules.json").write_text(json.dumps([{"path": ""}, {"path": "1_Pooling"}]))
    (source / "1_Pooling").mkdir()
    (source / "1_Pooling" / "old.json").write_text("{}")
    out = tmp_path / "out"
    cli("rewrite", source, "-o", out, "-q", check=0)
    (source / "1_Pooling" / "old.json").unlink()
    (source / "1_Pooling" / "config.json").write_text('{"new": 1}')
    cli("rewrite", source, "-o", out, "--force", "-q", check=0)
    assert sorted(p.name for p in (out / "1_Pooling").iterdir()) == ["config.json"]
    assert leftovers(tmp_path) == [] and leftovers(out) == []


def test_force_replaces_only_the_kind_of_thing_it_writes(tmp_path, source):
    plain = tmp_path / "models"
    plain.write_text("a file, not an export")
    proc = cli("rewrite", source, "-o", plain, "--force", "-q")
    assert proc.returncode == 2 and "not a directory" in proc.stderr
    assert plain.read_text() == "a file, not an export"
    folder = tmp_path / "w.safetensors"
    folder.mkdir()
    (folder / "x").write_text("mine")
    proc = cli("rewrite", source, "-o", folder, "--force", "-q", "--no-copy-files")
    assert proc.returncode == 2 and "is a directory" in proc.stderr
    assert (folder / "x").read_text() == "mine"
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("target", ["out", "out.safetensors"])
def test_a_failed_commit_names_the_final_path(tmp_path, source, monkeypatch, target):
    def broken(path):
        raise OSError(errno.EIO, "Input/output error", str(path))

    monkeypatch.setattr(atomic, "fsync_dir", broken)
    plan = compile_plan(open_checkpoint(source), copy_files=False)
    with pytest.raises(OutputError) as e:
        write_plan(plan, tmp_path / target)
    assert e.value.path == str(tmp_path / target) and "Input/output error" in str(e.value)
    assert "streamck-tmp" not in str(e.value)
    assert leftovers(tmp_path) == []


# 2. A closed stdout ends a listing quietly, keeps diff's answer, and fails only a streamed checkpoint.


def many_names(n=3000):
    letters = "abcdefghijklmnopqrstuvwxyz"
    return ["".join(letters[(i // 26**k) % 26] for k in range(4)) + ".block.attention.weight" for i in range(n)]


@pytest.fixture
def wide(tmp_path):
    a = save(tmp_path / "a.safetensors", {f"a.{n}": np.zeros(1, np.float32) for n in many_names()})
    b = save(tmp_path / "b.safetensors", {f"b.{n}": np.zeros(1, np.float32) for n in many_names()})
    return a, b


def closed_early(*args):
    """Run the CLI into a real pipe whose reader takes 100 bytes and closes it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamck", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
    )
    assert len(proc.stdout.read(100)) == 100
    proc.stdout.close()
    err = proc.stderr.read().decode()
    return proc.wait(timeout=60), err


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (("diff", "{a}", "{b}"), 1),
        (("diff", "{a}", "{b}", "--json"), 1),
        (("ls", "{a}"), 0),
        (("ls", "{a}", "--json"), 0),
        (("rewrite", "{a}", "--dry-run"), 0),
        (("hash", "{a}"), 0),
    ],
)
def test_closed_stdout_keeps_the_status(wide, args, code):
    a, b = wide
    args = [x.format(a=a, b=b) for x in args]
    assert len(cli(*args).stdout) > 100_000  # beyond a pipe's 64 KiB: the writer meets EPIPE
    assert closed_early(*args) == (code, "")


def test_closed_stdout_fails_a_streamed_checkpoint(wide):
    code, err = closed_early("rewrite", wide[0], "-o", "-")
    assert code == 2 and err == "streamck: error: stdout closed before the whole checkpoint was written\n"


# 3. A cleaner removes the temporaries of ended runs only: judged by their lock, not their pid.

LIVE_RUN = """
import os, sys, time
from pathlib import Path

target = int(sys.argv[1])
while True:  # pids in a new namespace count up from 1: fork until a child has the chosen one
    pid = os.fork()
    if pid == 0:
        if os.getpid() != target:
            os._exit(0)
        break
    os.waitpid(pid, 0)
    if pid >= target:
        sys.exit(0)
from streamck.writer.atomic import atomic_output

with atomic_output(Path(sys.argv[2]), sys.argv[3] == "dir", force=False):
    Path(sys.argv[4]).touch()
    time.sleep(120)
"""


def unused_pid():
    """A pid no process has in this namespace: a pid check here calls its owner dead."""
    return next(n for n in range(400, 30000) if not Path(f"/proc/{n}").exists())


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare for a pid namespace"
)
@pytest.mark.parametrize("target", ["out", "out.safetensors"])
def test_live_run_in_another_pid_namespace_keeps_its_temp(tmp_path, source, target):
    ready = tmp_path / "ready"
    kind = "dir" if target == "out" else "file"
    argv = [str(unused_pid()), str(tmp_path / target), kind, str(ready)]
    namespace = ["unshare", "--pid", "--fork", "--kill-child"]
    run = subprocess.Popen(
        [*namespace, sys.executable, "-c", LIVE_RUN, *argv], env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert run.poll() is None and time.monotonic() < deadline, "the run in the namespace never started"
            time.sleep(0.01)
        assert remove_stale(tmp_path) == []
        temps = leftovers(tmp_path)
        assert len(temps) == (1 if target == "out" else 2)  # a directory holds its lock; a file has one beside
        write_plan(compile_plan(open_checkpoint(source)), tmp_path / "other.safetensors")  # cleans up first
        assert leftovers(tmp_path) == temps
    finally:
        run.kill()  # --kill-child: the namespace goes with it
        run.wait(timeout=30)
    deadline = time.monotonic() + 30
    while leftovers(tmp_path):
        assert time.monotonic() < deadline, f"a killed run's temporaries stayed: {leftovers(tmp_path)}"
        remove_stale(tmp_path)
        time.sleep(0.05)


def test_a_temp_without_a_lock_is_left_until_a_day_old(tmp_path):
    stale = tmp_path / ".out.streamck-tmp-999999-0123abcd"  # no such pid, but no lock to say it ended
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"x")
    assert remove_stale(tmp_path) == [] and stale.exists()
    old = time.time() - 2 * 24 * 3600
    os.utime(stale, (old, old))
    assert remove_stale(tmp_path) == [stale] and not stale.exists()


# 4. Tensors nested in a torch pickle are read with dotted names, or a notice says why not.


def test_nested_dicts_lists_and_tuples_are_flattened(tmp_path):
    sd = {
        "w": torch.randn(2, 3),
        "sub": {"x": torch.randn(4), "deeper": {"y": torch.arange(3)}},
        "lst": [torch.randn(2), (torch.ones(1), 7)],
        "step": 3,
    }
    torch.save(sd, tmp_path / "m.pt")
    ckpt = open_checkpoint(tmp_path / "m.pt")
    assert sorted(ckpt.tensors) == ["lst.0", "lst.1.0", "sub.deeper.y", "sub.x", "w"]
    assert ckpt.notices == ["m.pt: skipped entries that are not tensors (2): lst.1.1, step"]
    write_plan(compile_plan(ckpt), tmp_path / "o.safetensors")
    got = load_file(tmp_path / "o.safetensors")
    assert torch.equal(got["sub.deeper.y"], sd["sub"]["deeper"]["y"]) and torch.equal(got["lst.1.0"], sd["lst"][1][0])
    proc = cli("ls", tmp_path / "m.pt")
    assert proc.returncode == 0 and proc.stderr == f"streamck: note: {ckpt.notices[0]}\n"


def test_the_one_dict_of_tensors_is_chosen_and_said(tmp_path):
    weights = {"layer.weight": torch.randn(3, 3), "layer.bias": torch.randn(3)}
    torch.save({"state_dict": weights, "epoch": 3, "optimizer_states": [{"m": torch.ones(2)}]}, tmp_path / "l.pt")
    ckpt = open_checkpoint(tmp_path / "l.pt")
    assert sorted(ckpt.tensors) == ["layer.bias", "layer.weight"]
    assert ckpt.notices == [  # issue 34: the model group beside training state
        "l.pt: read the model: 2 tensors under 'state_dict', that prefix taken off; "
        "left out: optimizer_states (1 tensor); --key '*' reads every group"
    ]
    torch.save({"state_dict": weights, "epoch": 3, "extra": [{"m": torch.ones(2)}]}, tmp_path / "o.pt")
    assert open_checkpoint(tmp_path / "o.pt").notices == [  # no training state beside: the one dict of tensors
        "o.pt: read the tensors under 'state_dict', the only dict holding any (see --key); "
        "left out: epoch, extra (tensors there: 1)"
    ]
    chosen = open_checkpoint(tmp_path / "l.pt", key="state_dict")
    assert chosen.tensors.keys() == ckpt.tensors.keys() and chosen.notices == []


def test_key_selects_one_of_several_dicts(tmp_path):
    torch.save({"model": {"a": torch.ones(2)}, "ema": {"a": torch.zeros(2)}}, tmp_path / "m.pt")
    assert sorted(open_checkpoint(tmp_path / "m.pt").tensors) == ["ema.a", "model.a"]
    assert list(open_checkpoint(tmp_path / "m.pt", key="ema").tensors) == ["a"]
    with pytest.raises(CheckpointError, match=r"no dict under key 'opt'; top-level dicts: 'model', 'ema'"):
        open_checkpoint(tmp_path / "m.pt", key="opt")
    save(tmp_path / "ema.safetensors", {"a": np.zeros(2, np.float32)})
    proc = cli("diff", tmp_path / "m.pt", tmp_path / "ema.safetensors", "--key", "ema", "--data")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ignored: safetensors files hold no nested dicts" in proc.stderr
    proc = cli("rewrite", tmp_path / "m.pt", "--key", "model", "-o", tmp_path / "o.safetensors", "-q")
    assert proc.returncode == 0 and torch.equal(load_file(tmp_path / "o.safetensors")["a"], torch.ones(2))
    hashes = json.loads(cli("hash", tmp_path / "m.pt", "--key", "model", "--json").stdout)
    assert list(hashes["tensors"]) == ["a"]


def test_dotted_names_that_collide_are_an_error(tmp_path):
    torch.save({"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}}, tmp_path / "m.pt")
    with pytest.raises(CheckpointError, match="two entries are named 'a.b'"):
        open_checkpoint(tmp_path / "m.pt")
