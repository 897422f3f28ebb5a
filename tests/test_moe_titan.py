"""``--plan torchtitan`` on Qwen3-MoE steps torchtitan 0.3.0's own CheckpointManager wrote
(FSDP2 and expert parallel EP=2, 2 gloo ranks: tests/titan_moe_fixtures.py). Oracle: torchtitan's
own convert_to_hf route (``dcp.load`` + ``Qwen3StateDictAdapter.to_hf``) tensor for tensor, and
transformers loading the output with no missing or unexpected keys. A routing bias that the
load-balancing hook moved is refused: to_hf drops it and the model routes differently."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import cli, script_checkpoints

torch = pytest.importorskip("torch")
pytest.importorskip("torchtitan", reason="torchtitan==0.3.0 (scripts/test installs it)")
pytestmark = pytest.mark.filterwarnings("ignore")

HERE = Path(__file__).parent


@pytest.fixture(scope="session")
def titan_moe(request, tmp_path_factory) -> dict[str, Path]:
    """The fixture folders by case, built once per fixture-script version (cached)."""
    return script_checkpoints(
        tmp_path_factory, "titan-moe", HERE / "titan_moe_fixtures.py", HERE.parent / "bench" / "standins.py"
    )


def _rewrite(case: Path, out: Path, *extra: str, plan: str = "torchtitan", check: int = 0):
    step = case / "checkpoint" / "step-1"
    return cli("rewrite", step, "-o", out, "--plan", plan, "--hf-config", case / "config.json", *extra, check=check)


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_moe_ep2"])
def test_same_tensors_as_to_hf(titan_moe, tmp_path, name):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    case = titan_moe[name]
    _rewrite(case, tmp_path / "out")
    got = load_file(tmp_path / "out" / "model.safetensors")
    want = load_file(case / "to_hf.safetensors")
    assert set(got) == set(want) and len(got) == 3 + 2 * (8 + 1 + 4 * 3)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info


def test_dry_run_says_moe_and_the_alias_still_works(titan_moe, tmp_path):
    out = _rewrite(titan_moe["qwen3_moe"], tmp_path / "out", "--dry-run", plan="torchtitan-llama3").stdout
    assert "MoE: 4 experts per layer" in out and "expert_bias_E of 2 layers: all zeros" in out
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in out and "45 tensors" in out


def test_expert_parallel_experts_come_from_their_rank(titan_moe):
    """Under EP=2 each rank file holds two of the four experts; each output expert is read from one."""
    from streamck.api import build_plan

    case = titan_moe["qwen3_moe_ep2"]
    plan = build_plan(case / "checkpoint" / "step-1", plan="torchtitan", hf_config=case / "config.json")
    files = {}
    for t in plan.tensors:
        if ".experts." in t.name:
            assert len(t.source.paths) == 1, t.name
            files.setdefault(t.name.split(".experts.")[1].split(".")[0], set()).update(t.source.paths)
    assert len({p.name for ps in files.values() for p in ps}) == 2


def test_routing_bias_refused(titan_moe, tmp_path):
    done = _rewrite(titan_moe["qwen3_moe_biased"], tmp_path / "out", check=2)
    assert "layers.0.moe.expert_bias_E holds a load-balancing routing bias" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_missing_expert_rank_refused(titan_moe, tmp_path):
    case = tmp_path / "case"
    shutil.copytree(titan_moe["qwen3_moe_ep2"], case)
    (case / "checkpoint" / "step-1" / "__1_0.distcp").unlink()
    done = _rewrite(case, tmp_path / "out", check=2)
    assert len(done.stderr.strip().splitlines()) == 1 and "__1_0.distcp" in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_experts": 8}, "has shape [4, 32], expected [8, 32] = [E, H] from E = num_experts"),
        # torchtitan's Qwen3-MoE router renormalises the top-k weights (route_norm=True)
        ({"norm_topk_prob": False}, "norm_topk_prob must be true"),
    ],
)
def test_config_must_match_the_model(titan_moe, tmp_path, change, message):
    case = tmp_path / "case"
    shutil.copytree(titan_moe["qwen3_moe"], case)
    config = json.loads((case / "config.json").read_text())
    if "num_experts" in change:  # transformers writes num_local_experts (num_experts is its alias)
        config.pop("num_local_experts", None)
    config.update(change)
    (case / "config.json").write_text(json.dumps(config))
    done = _rewrite(case, tmp_path / "out", check=2)
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "out").exists()


def test_ls_says_moe(titan_moe):
    listed = cli("ls", titan_moe["qwen3_moe_ep2"] / "checkpoint" / "step-1", check=0).stdout
    assert "MoE: 4 experts, fused (torchtitan's grouped layout, 2 blocks)" in listed


def test_without_the_plan_a_note_names_it(titan_moe):
    """A torchtitan MoE step rewritten or listed without --plan names the plan (issue #36's hint)."""
    from helpers import says_the_plan

    case = titan_moe["qwen3_moe"]
    says_the_plan(case / "checkpoint" / "step-1", "torchtitan", "--hf-config", case / "config.json")


def test_expert_switches_refused_with_the_plan(titan_moe, tmp_path):
    done = _rewrite(titan_moe["qwen3_moe"], tmp_path / "out", "--keep-fused", check=2)
    assert "--keep-fused and --fuse-experts do not apply to --plan torchtitan" in done.stderr
    assert not (tmp_path / "out").exists()
