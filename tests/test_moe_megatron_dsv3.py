"""``--plan megatron-gpt`` on DeepSeek-V3 GPTModel checkpoints megatron-core 0.19.2's own
``dist_checkpointing.save`` wrote after one training step with expert parallelism 2 (2 gloo ranks
under torchrun: tests/megatron_dsv3_fixtures.py): multi-latent attention, dense first layer,
shared expert, sigmoid group-limited routing with a trained ``router.expert_bias``, plain RoPE and
YaRN, the norms under the local spec's names and under Transformer Engine's, and a tensor-parallel
2 save (its oracle megatron-core's own load of it at TP=1); the family from the config beside the
run (``model_type: deepseek_v3``). Oracles: megatron-core's own forward against transformers'
DeepseekV3ForCausalLM loading the output, the same forward with the routing bias zeroed on both
sides, and transformers' own save_pretrained names and dtypes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import cli, megatron_checkpoints, says_the_plan
from megatron_args import with_args

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.filterwarnings("ignore")

PLAN = "megatron-gpt"
# Megatron's and transformers' fp32 forwards of the same weights differed by < 1e-6 here.
ATOL = 1e-5


@pytest.fixture(scope="session")
def megatron_dsv3(request, tmp_path_factory) -> dict[str, Path]:
    return megatron_checkpoints(request, tmp_path_factory, "megatron_dsv3_fixtures.py", "megatron-dsv3", torchrun=True)


def _logits(model, tokens):
    with torch.no_grad():
        return model(input_ids=tokens).logits


@pytest.mark.parametrize("name", ["dsv3", "dsv3_yarn", "dsv3_te", "dsv3_tp2"])
def test_logits_and_names_match(megatron_dsv3, tmp_path, name):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    cli("rewrite", megatron_dsv3[name], "-o", tmp_path / "hf", "--plan", PLAN, check=0)
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32, output_loading_info=True)
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    oracle = torch.load(megatron_dsv3[name] / "oracle.pt")
    torch.testing.assert_close(_logits(model, oracle["tokens"]), oracle["logits"], rtol=0, atol=ATOL)
    model.save_pretrained(tmp_path / "again")  # transformers' own names for these weights
    want, mine = load_file(tmp_path / "again" / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert set(mine) == set(want) and all(torch.equal(mine[k], want[k]) for k in want)


def test_routing_bias_is_carried(megatron_dsv3, tmp_path):
    """The trained bias moves Megatron's logits measurably; the output's bias is nonzero, and with
    it zeroed transformers gives Megatron's logits without it: a lost bias would show."""
    from transformers import AutoModelForCausalLM

    cli("rewrite", megatron_dsv3["dsv3"], "-o", tmp_path / "hf", "--plan", PLAN, check=0)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    oracle = torch.load(megatron_dsv3["dsv3"] / "oracle.pt")
    assert (oracle["logits"] - oracle["unbiased"]).abs().max() > 100 * ATOL
    biases = [m.gate.e_score_correction_bias for m in model.model.layers[1:].modules() if hasattr(m, "gate")]
    assert len(biases) == 2 and all(b.abs().max() > 0 for b in biases)
    for b in biases:
        b.zero_()
    torch.testing.assert_close(_logits(model, oracle["tokens"]), oracle["unbiased"], rtol=0, atol=ATOL)


def test_dtype_keeps_the_bias_in_float32_as_save_pretrained(megatron_dsv3, tmp_path):
    """``--dtype bf16``: what transformers' save_pretrained writes from the model loaded in bf16
    (its DeepseekV3 keeps ``e_score_correction_bias`` in float32), tensor for tensor and dtype."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    cli("rewrite", megatron_dsv3["dsv3"], "-o", tmp_path / "hf", "--plan", PLAN, "--dtype", "bf16", check=0)
    AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16).save_pretrained(tmp_path / "again")
    want, mine = load_file(tmp_path / "again" / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert set(mine) == set(want)
    assert all(mine[k].dtype == want[k].dtype and torch.equal(mine[k], want[k]) for k in want)
    assert mine["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32


def test_experts_read_from_their_expert_parallel_rank(megatron_dsv3):
    from streamck.api import build_plan

    plan = build_plan(megatron_dsv3["dsv3"], plan=PLAN)
    ranks = {}
    for t in plan.tensors:
        if ".mlp.experts." in t.name:
            assert len(t.source.paths) == 1, t.name
            ranks.setdefault(t.source.paths[0].name, set()).add(int(t.name.split(".experts.")[1].split(".")[0]))
    assert sorted(map(sorted, ranks.values())) == [[0, 1], [2, 3]]
    assert not any(".mlp.experts." in t.name for t in plan.tensors if t.name.startswith("model.layers.0."))


def test_tensor_parallel_save_is_read_from_both_ranks(megatron_dsv3):
    """At TP=2 each rank holds half the rows of the column-parallel projections and of each
    expert's gate and up: an output is read from both ranks' files, exactly its own bytes."""
    from streamck.api import build_plan

    plan = build_plan(megatron_dsv3["dsv3_tp2"], plan=PLAN)
    for name in ("model.layers.1.self_attn.kv_b_proj.weight", "model.layers.2.mlp.experts.3.up_proj.weight"):
        out = next(t for t in plan.tensors if t.name == name)
        assert len(out.source.paths) == 2 and sum(r.length for r in out.source.runs()) == out.nbytes, name


def _case(src: Path, tmp_path: Path, rope: dict | None = None, **config) -> Path:
    case = tmp_path / "case"
    shutil.copytree(src, case)
    path = case / "config.json"
    given = json.loads(path.read_text())
    given["rope_parameters"] = {**given["rope_parameters"], **(rope or {})}
    path.write_text(json.dumps({**given, **config}))
    return case


@pytest.mark.parametrize(
    "case, config, message",
    [
        ("dsv3", {"n_routed_experts": 8}, "n_routed_experts is 8, the checkpoint's args.num_experts 4"),
        ("dsv3", {"intermediate_size": 64}, "intermediate_size is 64, the checkpoint's args.ffn_hidden_size 48"),
        ("dsv3", {"num_experts_per_tok": 1}, "num_experts_per_tok is 1, the checkpoint's args route to 2"),
        ("dsv3", {"first_k_dense_replace": 0}, "first_k_dense_replace is 0, the checkpoint's args.moe_layer_freq"),
        ("dsv3", {"topk_group": 2}, "n_group/topk_group are 2/2, the checkpoint's args"),
        ("dsv3", {"routed_scaling_factor": 1.0}, "routed_scaling_factor is 1.0, the checkpoint's args"),
        ("dsv3", {"norm_topk_prob": False}, "norm_topk_prob must be true"),
        ("dsv3", {"q_lora_rank": None}, "q_lora_rank is None, the checkpoint's args.q_lora_rank 24"),
        ("dsv3", {"rope_interleave": False}, "rope_interleave must be true"),
        # a larger vocabulary cannot be read, a smaller one would cut the embedding and head
        ("dsv3", {"vocab_size": 10**6}, "vocab_size is 1000000, the checkpoint's args.vocab_size"),
        ("dsv3", {"vocab_size": 64}, "vocab_size is 64, the checkpoint's args.vocab_size"),
        ("dsv3", {"model_type": "qwen3_moe"}, "a multi-latent-attention GPTModel converts to deepseek_v3"),
        ("dsv3", {"rope": {"rope_type": "yarn", "factor": 4.0}}, "rope_type is 'yarn', the checkpoint's args"),
        ("dsv3_yarn", {"rope": {"factor": 8.0}}, "rope_parameters.factor is 8.0, the checkpoint's args"),
        ("dsv3_yarn", {"rope": {"mscale_all_dim": 0.0}}, "rope_parameters.mscale_all_dim is 0.0"),
        # megatron-core's own save with q_lora_rank None and no qk_layernorm: no norm on the kv latent
        ("dsv3_noq", {}, "args.qk_layernorm is off: Megatron's MLA then has no norm on its q / kv latents"),
    ],
)
def test_refused(megatron_dsv3, tmp_path, case, config, message):
    run = _case(megatron_dsv3[case], tmp_path, **config)
    done = cli("rewrite", run, "-o", tmp_path / "out", "--plan", PLAN, check=2)
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "out").exists()


def test_missing_expert_rank_refused(megatron_dsv3, tmp_path):
    case = _case(megatron_dsv3["dsv3"], tmp_path)
    (case / "iter_0000010" / "__1_0.distcp").unlink()
    done = cli("rewrite", case, "-o", tmp_path / "out", "--plan", PLAN, check=2)
    assert len(done.stderr.strip().splitlines()) == 1 and "__1_0.distcp" in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


def test_fused_down_projections_refused_with_the_reason(megatron_dsv3, tmp_path):
    """Issue #41: a run saved with --mla-down-proj-fusion (Transformer Engine's spec, so not on CPU: its
    args as such a run records them) is refused saying why, not as an unexpected key."""
    case = with_args(_case(megatron_dsv3["dsv3"], tmp_path), keep_config=True, mla_down_proj_fusion=True)
    done = cli("rewrite", case, "-o", tmp_path / "out", "--plan", PLAN, check=2)
    assert "args.mla_down_proj_fusion: the q and kv down-projections fused into one linear" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists(), done.stderr


def test_ls_says_moe(megatron_dsv3):
    """Per-layer expert keys ([E, 2F, H], dense layers mixed in) and stacked ones ([L, E, 2F, H])."""
    for name in ("dsv3", "dsv3_yarn"):
        assert "MoE: 4 experts, fused (Megatron's grouped layout, 2 blocks)" in cli("ls", megatron_dsv3[name]).stdout


@pytest.mark.parametrize("name", ["dsv3", "dsv3_yarn"])
def test_a_rewrite_without_the_plan_names_it(megatron_dsv3, name):
    says_the_plan(megatron_dsv3[name], PLAN)
