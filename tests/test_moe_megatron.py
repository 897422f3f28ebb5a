"""``--plan megatron-gpt`` on MoE GPTModel checkpoints megatron-core 0.19.2's own
``dist_checkpointing.save`` wrote with expert parallelism 2 (SequentialMLP experts, 2 gloo ranks:
tests/megatron_moe_fixtures.py): Qwen3-MoE, Mixtral and Qwen2-MoE, the family from the config
beside the run, and Qwen3-MoE saved at tensor parallel 2. Oracles: megatron-core's own forward
(EP=2; for TP=2, of its own load at TP=1) against transformers loading the output, and
transformers' own save_pretrained names for the loaded model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import cli, megatron_checkpoints

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.filterwarnings("ignore")

PLAN = "megatron-gpt"


@pytest.fixture(scope="session")
def megatron_moe(request, tmp_path_factory) -> dict[str, Path]:
    return megatron_checkpoints(request, tmp_path_factory, "megatron_moe_fixtures.py", "megatron-moe")


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "qwen2_moe", "qwen3_moe_tp2", "mixtral_te"])
def test_logits_and_names_match(megatron_moe, tmp_path, name):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    cli("rewrite", megatron_moe[name], "-o", tmp_path / "hf", "--plan", PLAN, check=0)
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    oracle = torch.load(megatron_moe[name] / "oracle.pt")
    with torch.no_grad():
        got = model(input_ids=oracle["tokens"]).logits
    torch.testing.assert_close(got, oracle["logits"], rtol=0, atol=1e-5)
    model.save_pretrained(tmp_path / "again")  # transformers' own names for these weights
    want, mine = load_file(tmp_path / "again" / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert set(mine) == set(want) and all(torch.equal(mine[k], want[k]) for k in want)


def test_transformer_engine_names_its_norm_before_the_experts(megatron_moe):
    """What a GPU run (Transformer Engine's spec) saves: the norm before the experts under its own
    module's name, which the local spec saves under the dense layer's fused norm name."""
    from streamck.source import open_checkpoint

    te = open_checkpoint(megatron_moe["mixtral_te"] / "iter_0000010").tensors
    local = open_checkpoint(megatron_moe["mixtral"] / "iter_0000010").tensors
    assert "decoder.layers.pre_mlp_layernorm.weight" in te and "decoder.layers.pre_mlp_layernorm.weight" not in local
    assert "decoder.layers.mlp.linear_fc1.layer_norm_weight" in local


def test_experts_read_from_their_expert_parallel_rank(megatron_moe):
    from streamck.api import build_plan

    plan = build_plan(megatron_moe["qwen3_moe"], plan=PLAN)
    ranks = {}
    for t in plan.tensors:
        if ".experts." in t.name:
            assert len(t.source.paths) == 1, t.name
            ranks.setdefault(t.source.paths[0].name, set()).add(int(t.name.split(".experts.")[1].split(".")[0]))
    assert sorted(map(sorted, ranks.values())) == [[0, 1], [2, 3]]


def _case(src: Path, tmp_path: Path, **config) -> Path:
    case = tmp_path / "case"
    shutil.copytree(src, case)
    path = case / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return case


@pytest.mark.parametrize(
    "config, message",
    [
        ({"num_experts": 8}, "experts: the config says 8, the checkpoint's args 4"),
        ({"model_type": "llama"}, "model_type 'llama': MoE checkpoints convert to qwen3_moe, qwen2_moe, mixtral"),
        # Megatron took the softmax over every expert (pre-softmax): renormalising would reweigh them
        ({"case": "qwen2_moe", "norm_topk_prob": True}, "the config renormalises the top-k weights"),
        ({"case": "qwen2_moe", "shared_expert_intermediate_size": 8}, "shared expert's hidden size: the config says 8"),
        ({"case": "qwen2_moe", "model_type": "qwen3_moe"}, "model_type 'qwen3_moe' has q/k norms, this checkpoint has"),
        ({"num_experts_per_tok": 1}, "num_experts_per_tok is 1, the checkpoint's args route to 2"),
    ],
)
def test_refused(megatron_moe, tmp_path, config, message):
    name = config.pop("case", "qwen3_moe")
    done = cli("rewrite", _case(megatron_moe[name], tmp_path, **config), "-o", tmp_path / "out", "--plan",
               PLAN, check=2)  # fmt: skip
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "out").exists()


def test_missing_expert_rank_refused(megatron_moe, tmp_path):
    case = _case(megatron_moe["mixtral"], tmp_path)
    (case / "iter_0000010" / "__1_0.distcp").unlink()
    done = cli("rewrite", case, "-o", tmp_path / "out", "--plan", PLAN, check=2)
    assert len(done.stderr.strip().splitlines()) == 1 and "__1_0.distcp" in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


def test_ls_says_moe(megatron_moe):
    listed = cli("ls", megatron_moe["mixtral"], check=0).stdout
    assert "MoE: 4 experts, fused (Megatron's grouped layout, 2 blocks)" in listed


def test_tensor_parallel_save_is_read_in_quarters(megatron_moe):
    """At TP=2 each expert's linear_fc1 is four chunks (each rank's half of gate, then of up):
    an output gate or up is read from both ranks' files, exactly its own bytes."""
    from streamck.api import build_plan

    plan = build_plan(megatron_moe["qwen3_moe_tp2"], plan=PLAN)
    fc1 = plan.source.tensors["decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    assert {t.sizes for t in fc1.tiles} == {(1, 1, 12, 32)} and len(fc1.tiles) == 2 * 4 * 4
    up = next(t for t in plan.tensors if t.name == "model.layers.1.mlp.experts.3.up_proj.weight")
    assert len(up.source.paths) == 2 and sum(r.length for r in up.source.runs()) == up.nbytes
