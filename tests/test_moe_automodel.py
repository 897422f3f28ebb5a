"""NeMo Automodel 0.7.0 MoE steps (tests/automodel_moe_fixtures.py, under torchrun on gloo): its
own Qwen3-MoE, DeepSeek-V3 and gpt-oss with expert parallelism 2 + FSDP, whose adapters save what
the Hugging Face families hold on disk (per-expert tensors; gpt-oss fused), and a transformers
Mixtral under its FSDP2, saved with fused runtime experts (Automodel's consolidation keeps them
fused). ``streamck rewrite STEP -o out``, and the run root with ``--step latest``, write what
``save_pretrained`` writes for the same weights, bit for bit: per-expert tensors under the family's
names (gpt-oss fused, as it saves them), loading in ``from_pretrained`` with no missing or
unexpected keys and the trained model's logits. Every checkpoint config a user picks: sharded
safetensors (``save_consolidated: false``), Automodel's consolidation (``final``), and native DCP
(``model_save_format: torch_save``), which saves no config.json."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import cli, fixture_root, missing

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.filterwarnings("ignore")
FAMILIES = ("qwen3_moe", "deepseek_v3", "gpt_oss", "mixtral")
# An expert tensor of each family's save_pretrained names.
EXPERT = {
    "qwen3_moe": "model.layers.1.mlp.experts.3.up_proj.weight",
    "deepseek_v3": "model.layers.1.mlp.experts.3.up_proj.weight",
    "gpt_oss": "model.layers.1.mlp.experts.gate_up_proj_bias",
    "mixtral": "model.layers.1.block_sparse_moe.experts.3.w3.weight",
}
# The trainer's fp32 forward against transformers' on the written weights: 0.0 seen for Qwen3-MoE
# (Automodel's own and transformers' agree bit for bit on the CPU), 3e-8 for DeepSeek-V3 and Mixtral,
# 2.4e-7 for gpt-oss (Automodel's eager FlexAttention with sinks against transformers' eager attention).
ATOL = 1e-5


@pytest.fixture(scope="session")
def runs(request, tmp_path_factory) -> Path:
    try:
        import nemo_automodel  # noqa: F401
    except ImportError:
        missing("nemo-automodel==0.7.0 (scripts/test installs it)")
    import automodel_moe_fixtures

    code = ("tests/automodel_moe_fixtures.py", "tests/moe_models.py", "tests/trainer_fixtures.py")
    root = fixture_root(tmp_path_factory, "automodel-moe", *code)
    return automodel_moe_fixtures.make_automodel_moe_runs(root)


def _tensors(path: Path) -> dict:
    from safetensors import safe_open

    found = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            found |= {k: h.get_tensor(k) for k in h.keys()}
    return found


def _is_save_pretrained(out: Path, fam: Path) -> None:
    """``out`` holds exactly the tensors save_pretrained wrote (names, dtypes, bits), loads with
    no missing/unexpected keys and gives the trained model's logits."""
    from moe_models import logits
    from transformers import AutoModelForCausalLM

    got, want = _tensors(out), _tensors(fam / "hf")
    assert set(got) == set(want), sorted(set(got) ^ set(want))[:10]
    assert EXPERT[fam.name] in got
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    trained = torch.load(fam / "logits.pt", weights_only=True)
    assert torch.allclose(logits(model.eval()), trained, rtol=0, atol=ATOL)


@pytest.mark.parametrize("run", ["sharded", "consolidated"])
@pytest.mark.parametrize("family", FAMILIES)
def test_step_is_save_pretrained(runs, family, run, tmp_path):
    done = cli("rewrite", runs / family / run / "epoch_0_step_2", "-o", tmp_path / "out", check=0)
    assert "note" not in done.stderr, done.stderr
    _is_save_pretrained(tmp_path / "out", runs / family)


@pytest.mark.parametrize("run", ["sharded", "consolidated"])
@pytest.mark.parametrize("family", FAMILIES)
def test_run_root_latest_is_save_pretrained(runs, family, run, tmp_path):
    done = cli("rewrite", runs / family / run, "--step", "latest", "-o", tmp_path / "out", check=0)
    assert "epoch_0_step_2 (LATEST)" in done.stderr
    _is_save_pretrained(tmp_path / "out", runs / family)


def test_automodel_consolidation_of_a_transformers_moe_is_fused(runs):
    """Why the consolidated step is rewritten too: for a transformers MoE, Automodel's own
    consolidation holds the fused runtime experts, not save_pretrained's names."""
    names = set(_tensors(runs / "mixtral" / "consolidated" / "epoch_0_step_2" / "model" / "consolidated"))
    assert "model.layers.1.mlp.experts.gate_up_proj" in names and EXPERT["mixtral"] not in names


@pytest.mark.parametrize("family", FAMILIES)
def test_torch_save_step_says_where_the_config_goes(runs, family, tmp_path):
    """Native DCP (torch_save) saves no config.json: the rewrite says so and where to put it;
    put there, the step comes out as save_pretrained's."""
    run = tmp_path / "run"
    shutil.copytree(runs / family / "torch_save", run, symlinks=True)
    done = cli("rewrite", run, "--step", "latest", "-o", tmp_path / "bare", check=0)
    assert sum("torch_save saves none" in line and "model/" in line for line in done.stderr.splitlines()) == 1
    shutil.copy(runs / family / "hf" / "config.json", run / "epoch_0_step_2" / "model" / "config.json")
    done = cli("rewrite", run, "--step", "latest", "-o", tmp_path / "out", check=0)
    assert "config.json" not in done.stderr, done.stderr
    _is_save_pretrained(tmp_path / "out", runs / family)


@pytest.mark.parametrize("family", FAMILIES)
def test_ls_says_moe(runs, family):
    listed = cli("ls", runs / family / "sharded" / "epoch_0_step_2", check=0).stdout
    kind = "fused (2 blocks)" if family in ("mixtral", "gpt_oss") else "per-expert (2 blocks)"
    if family == "deepseek_v3":  # its first layer is dense
        kind = "per-expert (1 blocks)"
    assert f"MoE: 4 experts, {kind}" in listed


@pytest.mark.parametrize("rank", [1, 2])
@pytest.mark.parametrize("family", FAMILIES)
def test_missing_rank_file_is_refused(runs, family, rank, tmp_path):
    """One rank's shard gone (for Qwen3-MoE, the experts of one expert-parallel rank with it):
    one line, nothing written."""
    step = tmp_path / "step"
    shutil.copytree(runs / family / "sharded" / "epoch_0_step_2", step)
    next((step / "model").glob(f"shard-{rank:05d}-*")).unlink()
    done = cli("rewrite", step, "-o", tmp_path / "out", check=2)
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "out").exists()


def test_a_fused_expert_is_read_by_its_own_rows(runs):
    """Mixtral's fused experts, split over the two rank files: each per-expert output reads its
    own rows only (its byte runs add up to its size), never the [E, 2I, H] tensor."""
    from streamck.api import build_plan

    plan = build_plan(runs / "mixtral" / "sharded" / "epoch_0_step_2")
    experts = [t for t in plan.tensors if ".experts." in t.name]
    assert len(experts) == 2 * 4 * 3
    fused = plan.source.tensors["model.layers.0.mlp.experts.gate_up_proj"]
    assert fused.shape[0] == 4 and len(fused.tiles) == 2  # FSDP2 sharded the experts over both ranks
    for t in experts:
        whole = plan.source.tensors[t.source.name.partition("[")[0]]  # the fused tensor it is cut from
        assert sum(r.length for r in t.source.runs()) == t.nbytes and t.nbytes * 4 <= whole.nbytes
