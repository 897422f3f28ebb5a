"""DCP as trainers write it (issue 24): every layout of tests/dcp_trainers.py, written by
torch's own writers, rewrites to what torch's own dcp_to_torch_save reads back; what
cannot be read is refused in one line, and a training format never yields an empty output."""

import resource
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from dcp_trainers import MANY, torch_oracle
from helpers import REPO, cli
from safetensors.torch import load_file

from streamck import open_checkpoint


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t.contiguous()), name


def rewritten(src: Path, tmp_path: Path, *args: str) -> dict[str, torch.Tensor]:
    out = tmp_path / "out.safetensors"
    cli("rewrite", src, "-o", out, "--verify", *args, check=0)  # a missing parent folder is created
    return load_file(out)


@pytest.mark.parametrize("layout", ["fsdp2", "tp", "hsdp", "multi", "ddp", "grid", "noflat"])
def test_equals_torch_reading_it_back(dcp_trainers, tmp_path, layout):
    src = dcp_trainers[layout]
    every = ("--key", "*") if layout in ("fsdp2", "noflat") else ()  # a model beside its optimizer: all of it
    assert_same(rewritten(src, tmp_path, *every), torch_oracle(src, tmp_path / "oracle.pt"))


def test_strided_blobs_are_gathered(dcp_trainers):
    # DDP with channels_last convs and a transposed view: dcp.save keeps their strides
    tensors = open_checkpoint(dcp_trainers["ddp"]).tensors
    assert tensors["module.0.weight"].strides == (27, 1, 9, 3)
    assert tensors["module.proj_t"].strides == (1, 7)
    assert tensors["module.0.bias"].strides is None


def test_empty_chunk_with_odd_strides(dcp_trainers):
    # [Shard(0), Shard(1)] of a (1, 6) tensor on a 2x2 mesh: ranks 2 and 3 save (0, 3) chunks
    assert sorted(open_checkpoint(dcp_trainers["grid"]).tensors) == ["mat", "row"]


def test_flatten_false_reads_the_pickled_dicts(dcp_trainers, tmp_path):
    # torch pickles each nested dict whole: {"model": {...}} is one non-tensor item
    got = rewritten(dcp_trainers["noflat"], tmp_path, "--key", "*")
    assert "model.layers.0.w1.weight" in got and "optimizer.state.0.exp_avg" in got
    model = rewritten(dcp_trainers["noflat"], tmp_path / "m")  # by default the model group, its prefix off
    assert sorted(model) == sorted(k.removeprefix("model.") for k in got if k.startswith("model."))


def test_flatten_false_with_dtensors_is_refused(dcp_trainers, tmp_path):
    src = dcp_trainers["noflat_dtensor"]
    for args in (("ls", src), ("rewrite", src, "-o", tmp_path / "out"), ("rewrite", src, "--dry-run")):
        r = cli(*args)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert "no tensors in this DCP checkpoint" in r.stderr and "flatten_state_dict=False" in r.stderr
        assert "'model' holds DTensors" in r.stderr
    assert not (tmp_path / "out").exists()


def test_no_training_format_yields_an_empty_output(dcp_trainers, tmp_path):
    # a DCP save of non-tensor items only: refused, never "wrote 0 tensors"
    import torch.distributed.checkpoint as dcp

    src = tmp_path / "states"
    dcp.save({"step": 3, "rng": {"seed": 1}}, storage_writer=dcp.FileSystemWriter(str(src)), no_dist=True)
    r = cli("rewrite", src, "-o", tmp_path / "out.safetensors")
    assert r.returncode == 2 and "no tensors in this DCP checkpoint" in r.stderr
    assert not (tmp_path / "out.safetensors").exists()
    assert cli("ls", src).returncode == 2


def _limited(args: list, limit: int) -> subprocess.CompletedProcess:
    """``python -m streamck ARGS`` under a descriptor limit (``ulimit -n``)."""

    def lower():
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, "-m", "streamck", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, preexec_fn=lower)


def test_more_files_than_the_descriptor_limit(dcp_trainers, tmp_path):
    src = dcp_trainers["many"]  # single_file_per_rank=False: one file per item
    assert len(list(src.glob("*.distcp"))) == MANY > 256
    r = _limited(["rewrite", src, "-o", tmp_path / "out", "--verify"], 256)
    assert r.returncode == 0, r.stderr
    assert_same(load_file(tmp_path / "out" / "model.safetensors"), torch_oracle(src, tmp_path / "oracle.pt"))


def test_skipped_items_fold_per_group_and_quiet_keeps_what_needs_action(dcp_trainers, tmp_path):
    src = dcp_trainers["fsdp2"]
    notes = cli("ls", src, "--key", "*", check=0).stderr.splitlines()
    assert len(notes) == 2  # 12 optimizer items in one line; the train state
    assert notes[0].startswith("streamck: note: optimizer: 12 non-tensor items skipped (optimizer.param_groups.0.lr,")
    assert notes[1] == "streamck: note: train_state: 1 non-tensor item skipped (train_state.step)"
    model = cli("ls", src, check=0).stderr.splitlines()
    assert len(model) == 1 and model[0].startswith("streamck: note: read the model: 12 tensors under 'model'")
    quiet = cli("rewrite", src, "-o", tmp_path / "out.safetensors", "-q", check=0).stderr.splitlines()
    assert quiet == model  # what was left out, and how to have it: kept under -q


def test_hf_writer_pickle_in_front_is_named(tmp_path):
    import torch.distributed.checkpoint as dcp

    src = tmp_path / "hf"  # torch's own writer, given a non-tensor item
    writer = dcp.HuggingFaceStorageWriter(str(src), save_distributed=True)
    dcp.save({"w": torch.ones(2, 3), "step": 3}, storage_writer=writer, no_dist=True)
    r = cli("ls", src)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "starts with a pickled non-tensor item, not a safetensors header" in r.stderr
    assert "HuggingFaceStorageWriter" in r.stderr and "header length" not in r.stderr


def test_distcp_files_without_metadata(dcp_trainers, tmp_path):
    copy = tmp_path / "copy"
    copy.mkdir()
    subprocess.run(f"cp {dcp_trainers['fsdp2']}/* {copy}/", shell=True, check=True)
    assert not (copy / ".metadata").exists()  # the shell's glob leaves the hidden file behind
    r = cli("rewrite", copy, "-o", tmp_path / "out")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "*.distcp files, but no .metadata" in r.stderr and "`cp dir/*` leaves it behind" in r.stderr


def test_f4_to_torch_output_refused_at_plan_time(tmp_path):
    src = tmp_path / "f4.safetensors"  # safetensors' own writer: torch's float4_e2m1fn_x2 is F4
    safetensors.torch.save_file({"w": torch.zeros(2, 4, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)}, src)
    out, d = tmp_path / "out.bin", tmp_path / "d"
    for args in (
        ["-o", out, "--dry-run"],
        ["-o", out],
        ["-o", d, "--format", "torch"],
        ["-o", d, "--format", "torch", "--dry-run"],
    ):
        r = cli("rewrite", src, *args)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert "torch.save output cannot hold w (F4)" in r.stderr
    assert not out.exists() and not d.exists()
