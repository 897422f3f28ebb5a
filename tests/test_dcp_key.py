"""Model + optimizer DCP saves (issue 24, item 7): ``--key`` takes one top-level group, its
prefix off; ``ls`` and ``rewrite`` say which groups are there and the flag that takes the
weights alone. Fixtures: tests/dcp_trainers.py (FSDP2 + AdamW, get_state_dict)."""

import re

import pytest
import torch
from dcp_trainers import torch_oracle
from helpers import cli
from safetensors.torch import load_file

import streamck
from streamck import CheckpointError, open_checkpoint

GROUPS = "top-level groups: model 12 tensors, optimizer 36 tensors + 12 other items, train_state 1 other item"


@pytest.fixture(scope="module")
def oracle(dcp_trainers, tmp_path_factory):
    return torch_oracle(dcp_trainers["fsdp2"], tmp_path_factory.mktemp("oracle") / "fsdp2.pt")


def test_ls_and_rewrite_name_the_groups_and_the_flag(dcp_trainers, tmp_path):
    src = dcp_trainers["fsdp2"]
    line = f"streamck: note: {GROUPS}; --key model takes the weights alone\n"
    assert line in cli("ls", src, check=0).stderr
    assert line in cli("rewrite", src, "--dry-run", check=0).stderr
    assert line in cli("rewrite", src, "-o", tmp_path / "all.safetensors", "-q", check=0).stderr


def test_key_model_takes_the_weights_alone(dcp_trainers, oracle, tmp_path):
    out = tmp_path / "model.safetensors"
    r = cli("rewrite", dcp_trainers["fsdp2"], "--key", "model", "-o", out, "--verify", check=0)
    assert "top-level groups" not in r.stderr
    got = load_file(out)
    want = {k.removeprefix("model."): v for k, v in oracle.items() if k.startswith("model.")}
    assert sorted(got) == sorted(want) and len(got) == 12
    for name, t in want.items():
        assert torch.equal(got[name], t), name


def test_key_in_the_library(dcp_trainers, oracle):
    m = streamck.ls(dcp_trainers["fsdp2"], key="optimizer")
    assert len(m["tensors"]) == 36 and "state.layers.0.w1.weight.exp_avg" in m["tensors"]
    ckpt = open_checkpoint(dcp_trainers["fsdp2"], key="optimizer")
    assert torch.equal(
        torch.frombuffer(bytearray(ckpt.read("state.embed.weight.exp_avg")), dtype=torch.float32).reshape(64, 16),
        oracle["optimizer.state.embed.weight.exp_avg"],
    )


def test_dcp_tutorial_app_state(dcp_trainers, oracle, tmp_path):
    src = dcp_trainers["app"]
    line = "top-level groups: app.model 12 tensors, app.optim 36 tensors + 12 other items; "
    assert line + "--key app.model takes the weights alone" in cli("ls", src, check=0).stderr
    got = streamck.ls(src, key="app.model")["tensors"]
    assert sorted(got) == sorted(k.removeprefix("model.") for k in oracle if k.startswith("model."))


def test_unknown_key_names_the_groups(dcp_trainers, tmp_path):
    with pytest.raises(CheckpointError, match=re.escape(f"no tensors under key 'weights'; {GROUPS}") + "$"):
        open_checkpoint(dcp_trainers["fsdp2"], key="weights")
    r = cli("rewrite", dcp_trainers["fsdp2"], "--key", "train_state", "-o", tmp_path / "out")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and not (tmp_path / "out").exists()
    assert "no tensors under key 'train_state'" in r.stderr


def test_torchtitan_groups_name_the_drop_that_leaves_the_weights(tmp_path):
    # torchtitan: model keys at the top, beside optimizer.*, lr_scheduler, train_state, dataloader
    from streamck.source.dcp import select

    tensors = ["tok_embeddings.weight", "layers.0.attention.wq.weight", "norm.weight", "optimizer.state.x.exp_avg"]
    others = ["optimizer.param_groups.lr", "lr_scheduler.last_epoch", "train_state.step", "dataloader.rank_0"]
    chosen, notes = select(tensors, others, None, tmp_path)
    assert list(chosen) == tensors
    assert notes[0] == (
        "top-level groups: tok_embeddings 1 tensor, layers 1 tensor, norm 1 tensor, optimizer 1 tensor + 1 other "
        "item, lr_scheduler 1 other item, train_state 1 other item, dataloader 1 other item; "
        "rewrite --drop 'optimizer.*' leaves the weights"
    )
    assert len(notes) == 5  # and one line per group of skipped items
