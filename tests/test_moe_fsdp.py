"""FSDP2 (``fully_shard`` + ``dcp.save``) and Trainer + FSDP checkpoints of transformers-5 MoE
models (Qwen3-MoE, Mixtral; tests/moe_fixtures.py, written under torchrun on gloo) come out as
save_pretrained writes the same weights, bit for bit: per-expert tensors under the family's
names, loading in from_pretrained with no missing or unexpected keys and the trainer's logits.
Each output expert reads only its own rows of the fused tensor."""

from __future__ import annotations

import shutil
from pathlib import Path

import moe_fixtures
import pytest
import torch
from helpers import cli, fixture_root
from moe_models import logits, tiny_model
from safetensors.torch import load_file

import streamck
from streamck.api import build_plan

pytestmark = pytest.mark.filterwarnings("ignore")
FAMILIES = moe_fixtures.FAMILIES


@pytest.fixture(scope="session")
def moe_runs(request, tmp_path_factory) -> dict[str, dict[str, Path]]:
    code = ("tests/moe_fixtures.py", "tests/moe_models.py", "tests/fsdp_fixtures.py", "tests/trainer_fixtures.py")
    root = fixture_root(tmp_path_factory, "moe-fsdp", *code)
    return moe_fixtures.make_moe_checkpoints(root)


def _equal(got: dict, want: dict) -> None:
    assert set(got) == set(want), sorted(set(got) ^ set(want))[:10]
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def _loads_as(out: Path, model_type: str, live: Path) -> None:
    """``out`` loads with no missing/unexpected keys and gives the logits of the trained weights."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    trained = tiny_model(model_type)
    trained.load_state_dict(torch.load(live, weights_only=True))
    assert torch.equal(logits(model.eval()), logits(trained))


@pytest.mark.parametrize("model_type", FAMILIES)
def test_fsdp2_dcp_save_is_save_pretrained(moe_runs, model_type, tmp_path):
    run = moe_runs[model_type]
    done = cli("rewrite", str(run["fsdp2"]), "-o", str(tmp_path / "out"), check=0)
    assert "config.json" not in done.stderr  # no note: the family was known
    _equal(load_file(tmp_path / "out" / "model.safetensors"), load_file(run["hf"] / "model.safetensors"))
    _loads_as(tmp_path / "out", model_type, run["live"])


@pytest.mark.parametrize("model_type", FAMILIES)
def test_trainer_fsdp_checkpoint_is_save_pretrained(moe_runs, model_type, tmp_path):
    run = moe_runs[model_type]
    streamck.rewrite(run["trainer"], tmp_path / "out")
    want = tiny_model(model_type)
    want.load_state_dict(torch.load(run["trainer_live"], weights_only=True))
    want.save_pretrained(tmp_path / "hf")
    _equal(load_file(tmp_path / "out" / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors"))
    _loads_as(tmp_path / "out", model_type, run["trainer_live"])


@pytest.mark.parametrize("model_type", FAMILIES)
def test_keep_fused_is_the_runtime_state_dict(moe_runs, model_type, tmp_path):
    run = moe_runs[model_type]
    streamck.rewrite(run["fsdp2"], tmp_path / "out", experts="keep")
    _equal(load_file(tmp_path / "out" / "model.safetensors"), torch.load(run["live"], weights_only=True))


def test_an_expert_reads_its_own_rows_only(moe_runs):
    """Every per-expert output is a row range of one expert of the fused DCP tensor: its byte runs
    add up to its own size, so no step reads (or holds) the [E, 2I, H] tensor."""
    plan = build_plan(moe_runs["qwen3_moe"]["fsdp2"])
    experts = [t for t in plan.tensors if ".experts." in t.name]
    assert len(experts) == 2 * 4 * 3
    fused = plan.source.tensors["model.layers.0.mlp.experts.gate_up_proj"]
    assert fused.shape[0] == 4 and len(fused.tiles) == 2  # FSDP2 sharded the experts over both ranks
    for t in experts:
        whole = plan.source.tensors[t.source.name.partition("[")[0]]  # the fused tensor it is cut from
        assert sum(r.length for r in t.source.runs()) == t.nbytes and t.nbytes * 4 <= whole.nbytes


def test_missing_rank_file_is_refused(moe_runs, tmp_path):
    src = tmp_path / "fsdp2"
    shutil.copytree(moe_runs["mixtral"]["fsdp2"], src)
    (src / "__1_0.distcp").unlink()
    done = cli("rewrite", str(src), "-o", str(tmp_path / "out"), check=2)
    assert len(done.stderr.strip().splitlines()) == 1 and "__1_0.distcp" in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()
