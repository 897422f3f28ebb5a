"""NeMo Automodel 0.7.0 MoE steps (tests/automodel_moe_fixtures.py: its own Qwen3-MoE and
Checkpointer, expert parallelism 2 + FSDP under torchrun on gloo) come out of ``streamck rewrite
STEP -o out`` and of the run root with ``--step latest`` as ``save_pretrained`` writes the same
weights, bit for bit: per-expert tensors, loading in ``from_pretrained`` with no missing or
unexpected keys and Automodel's own logits. Every checkpoint config a user picks: sharded
safetensors (``save_consolidated: false``), Automodel's consolidation (``final``), and native DCP
(``model_save_format: torch_save``), which saves no config.json."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import cli, missing

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.filterwarnings("ignore")
# Automodel's fp32 forward against transformers' on the same weights: 0.0 seen (both fp32 on CPU).
ATOL = 1e-5


@pytest.fixture(scope="session")
def runs(request, tmp_path_factory) -> Path:
    try:
        import nemo_automodel  # noqa: F401
    except ImportError:
        missing("nemo-automodel==0.7.0 (scripts/test installs it)")
    import automodel_moe_fixtures

    cache = getattr(request.config, "cache", None)
    root = Path(cache.mkdir("streamck-automodel-moe")) if cache is not None else tmp_path_factory.mktemp("am-moe")
    return automodel_moe_fixtures.make_automodel_moe_runs(root)


def _tensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


def _is_save_pretrained(out: Path, runs: Path) -> None:
    """``out`` holds exactly the tensors save_pretrained wrote (names, dtypes, bits), loads with
    no missing/unexpected keys and gives Automodel's logits."""
    from moe_models import logits
    from transformers import AutoModelForCausalLM

    got, want = _tensors(out), _tensors(runs / "hf")
    assert set(got) == set(want), sorted(set(got) ^ set(want))[:10]
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in got
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    auto = torch.load(runs / "automodel_logits.pt", weights_only=True)
    assert torch.allclose(logits(model.eval()), auto, rtol=0, atol=ATOL)


@pytest.mark.parametrize("run", ["sharded", "consolidated"])
def test_step_is_save_pretrained(runs, run, tmp_path):
    done = cli("rewrite", runs / run / "epoch_0_step_2", "-o", tmp_path / "out", check=0)
    assert "note" not in done.stderr, done.stderr
    _is_save_pretrained(tmp_path / "out", runs)


@pytest.mark.parametrize("run", ["sharded", "consolidated"])
def test_run_root_latest_is_save_pretrained(runs, run, tmp_path):
    done = cli("rewrite", runs / run, "--step", "latest", "-o", tmp_path / "out", check=0)
    assert "epoch_0_step_2 (LATEST)" in done.stderr
    _is_save_pretrained(tmp_path / "out", runs)


def test_consolidated_step_equals_automodel_consolidation(runs, tmp_path):
    """The sharded step, rewritten, holds what Automodel's own consolidation wrote for the same step."""
    from safetensors import safe_open

    cli("rewrite", runs / "sharded" / "epoch_0_step_2", "-o", tmp_path / "out", check=0)
    consolidated = runs / "consolidated" / "epoch_0_step_2" / "model" / "consolidated"
    theirs = {}
    for f in consolidated.glob("*.safetensors"):
        with safe_open(f, "pt") as h:
            theirs |= {k: h.get_tensor(k) for k in h.keys()}
    ours = _tensors(tmp_path / "out")
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_torch_save_step_says_add_the_config(runs, tmp_path):
    """Native DCP (torch_save) saves no config.json: the rewrite says so; with the model's config
    added, as the note says, it is save_pretrained's."""
    done = cli("rewrite", runs / "torch_save", "--step", "latest", "-o", tmp_path / "out", check=0)
    notes = [line for line in done.stderr.splitlines() if "config.json" in line]
    assert len(notes) == 1 and "torch_save" in notes[0], done.stderr
    assert not (tmp_path / "out" / "config.json").exists()
    shutil.copy(runs / "hf" / "config.json", tmp_path / "out" / "config.json")
    _is_save_pretrained(tmp_path / "out", runs)


def test_ls_says_per_expert(runs):
    listed = cli("ls", runs / "sharded" / "epoch_0_step_2", check=0).stdout
    assert "MoE: 4 experts, per-expert (2 blocks)" in listed


@pytest.mark.parametrize("rank", [1, 2])
def test_missing_expert_parallel_rank_is_refused(runs, rank, tmp_path):
    """One expert-parallel rank's shard gone (experts 0-1 or 2-3 with it): one line, nothing written."""
    step = tmp_path / "step"
    shutil.copytree(runs / "sharded" / "epoch_0_step_2", step)
    next((step / "model").glob(f"shard-{rank:05d}-*")).unlink()
    done = cli("rewrite", step, "-o", tmp_path / "out", check=2)
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "out").exists()
