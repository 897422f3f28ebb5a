"""``--plan torchtitan`` on DeepSeek-V3 steps torchtitan 0.3.0's own CheckpointManager wrote
(FSDP2 with a load-balancing bias moved by torchtitan's own hook; expert parallel EP=2 with an MTP
layer; 2 gloo ranks: tests/titan_dsv3_fixtures.py). Oracles: torchtitan's own convert_to_hf route
(``dcp.load`` + ``DeepSeekV3StateDictAdapter.to_hf``) tensor for tensor, transformers'
DeepseekV3ForCausalLM loading the output, and its logits against torchtitan's own forward of the
saved model (experts in fp32)."""

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
CASES = ("deepseek_v3", "deepseek_v3_ep2")


@pytest.fixture(scope="session")
def dsv3(request, tmp_path_factory) -> dict[str, Path]:
    """The fixture folders by case, built once per fixture-script version (cached)."""
    code = (HERE / "titan_moe_fixtures.py", HERE.parent / "bench" / "standins.py")
    return script_checkpoints(tmp_path_factory, "titan-dsv3", HERE / "titan_dsv3_fixtures.py", *code)


def _rewrite(case: Path, out: Path, *extra: str, check: int = 0):
    step = case / "checkpoint" / "step-1"
    return cli(
        "rewrite", step, "-o", out, "--plan", "torchtitan", "--hf-config", case / "config.json", *extra, check=check
    )


def _hf_logits(model):
    from titan_dsv3_fixtures import tokens

    with torch.no_grad():
        return model(tokens()).logits


@pytest.mark.parametrize("name", CASES)
def test_same_tensors_and_logits_as_torchtitan(dsv3, tmp_path, name):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    case = dsv3[name]
    _rewrite(case, tmp_path / "out")
    got = load_file(tmp_path / "out" / "model.safetensors")
    want = load_file(case / "to_hf.safetensors")
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    assert "model.layers.2.mlp.experts.3.down_proj.weight" in got and "model.layers.0.mlp.up_proj.weight" in got
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    # The MTP layer (num_hidden_layers + 0) is what to_hf writes; DeepseekV3ForCausalLM does not run it.
    # (transformers names its experts fused when it reports them).
    mtp = {k for k in want if k.startswith("model.layers.3.")}
    unexpected = set(info["unexpected_keys"])
    assert bool(mtp) == bool(unexpected) == (name == "deepseek_v3_ep2"), info
    assert all(k.startswith("model.layers.3.") for k in unexpected) and (
        not mtp or "model.layers.3.eh_proj.weight" in unexpected
    )
    assert torch.allclose(_hf_logits(model), torch.load(case / "logits.pt"), atol=1e-3, rtol=0)


def test_routing_bias_is_written_and_routes(dsv3, tmp_path):
    """The bias torchtitan's load-balancing hook moved is the router's e_score_correction_bias,
    and it matters: without it the same weights give other logits."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    case = dsv3["deepseek_v3"]
    _rewrite(case, tmp_path / "out")
    bias = load_file(tmp_path / "out" / "model.safetensors")["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and bias.abs().min() > 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    want = torch.load(case / "logits.pt")
    assert torch.allclose(_hf_logits(model), want, atol=1e-3, rtol=0)
    for layer in model.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.zero_()
    assert not torch.allclose(_hf_logits(model), want, atol=1e-3, rtol=0)


def test_dtype_keeps_the_routing_bias_in_fp32(dsv3, tmp_path):
    """--dtype bf16 writes what from_pretrained(dtype=bf16) + save_pretrained writes of the fp32
    conversion: everything bf16 but DeepSeek-V3's e_score_correction_bias (its class's
    _keep_in_fp32_modules_strict), which stays float32; the rewrite says so."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    case = dsv3["deepseek_v3"]
    _rewrite(case, tmp_path / "fp32")
    AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.bfloat16).save_pretrained(tmp_path / "oracle")
    done = _rewrite(case, tmp_path / "bf16", "--dtype", "bf16")
    assert "kept in their stored dtype, as transformers keeps deepseek_v3's" in done.stderr, done.stderr
    got = load_file(tmp_path / "bf16" / "model.safetensors")
    want = load_file(tmp_path / "oracle" / "model.safetensors")
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    assert got["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32


def test_dry_run_summary(dsv3, tmp_path):
    out = _rewrite(dsv3["deepseek_v3_ep2"], tmp_path / "out", "--dry-run").stdout
    assert "torchtitan 0.3 deepseek_v3: L=3" in out and "1 dense layer(s), 3 MoE with shared experts" in out
    assert "expert_bias_E of 3 of 3 MoE layers written" in out and "1 MTP layer(s) written as model.layers.3" in out
    assert "89 tensors" in out and not (tmp_path / "out").exists()


def test_expert_parallel_experts_come_from_their_rank(dsv3):
    """Under EP=2 each rank file holds two of the four experts; each output expert is read from one."""
    from streamck.api import build_plan

    case = dsv3["deepseek_v3_ep2"]
    plan = build_plan(case / "checkpoint" / "step-1", plan="torchtitan", hf_config=case / "config.json")
    files = set()
    for t in plan.tensors:
        if ".experts." in t.name and ".shared_experts." not in t.name:
            assert len(t.source.paths) == 1, t.name
            files |= {p.name for p in t.source.paths}
    assert files == {"__0_0.distcp", "__1_0.distcp"}


@pytest.mark.parametrize(
    "name, change, message",
    [
        ("deepseek_v3", {"rope_interleave": False}, "rope_interleave must be true"),
        ("deepseek_v3", {"first_k_dense_replace": 2}, "missing: layers.1.feed_forward.w1.weight"),
        ("deepseek_v3", {"q_lora_rank": None}, "missing: layers.0.attention.wq.weight"),
        ("deepseek_v3", {"n_routed_experts": 8}, "expected [8, 64] = [E, H] from E = n_routed_experts"),
        ("deepseek_v3", {"num_key_value_heads": 2}, "num_key_value_heads must equal num_attention_heads"),
        ("deepseek_v3_ep2", {"num_nextn_predict_layers": 0}, "has 1 MTP layer(s) (mtp_layers.N)"),
    ],
)
def test_config_must_match_the_model(dsv3, tmp_path, name, change, message):
    case = tmp_path / "case"
    shutil.copytree(dsv3[name], case)
    config = json.loads((case / "config.json").read_text())
    config.update(change)
    (case / "config.json").write_text(json.dumps(config))
    done = _rewrite(case, tmp_path / "out", check=2)
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "out").exists()
