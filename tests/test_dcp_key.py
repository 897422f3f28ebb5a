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


def test_model_beside_its_optimizer_reads_as_the_model(dcp_trainers, oracle, tmp_path):
    # issue 34: a model group beside training state is read by default, with a note saying how to have it all
    src = dcp_trainers["fsdp2"]
    line = (
        "streamck: note: read the model: 12 tensors under 'model', that prefix taken off; left out: optimizer 36 "
        "tensors + 12 other items, train_state 1 other item; --key '*' reads every group\n"
    )
    assert line in cli("ls", src, check=0).stderr
    assert line in cli("rewrite", src, "--dry-run", check=0).stderr
    assert line in cli("rewrite", src, "-o", tmp_path / "m.safetensors", "-q", check=0).stderr
    want = {k.removeprefix("model."): v for k, v in oracle.items() if k.startswith("model.")}
    got = load_file(tmp_path / "m.safetensors")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], v) for k, v in want.items())
    every = cli("ls", src, "--key", "*", check=0)
    assert GROUPS not in every.stderr and "optimizer.state.embed.weight.exp_avg" in every.stdout


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
    line = "read the model: 12 tensors under 'app.model', that prefix taken off; left out: app.optim 36 tensors"
    assert line in cli("ls", src, check=0).stderr
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
    from streamck.source.dcp.sharded import select

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
