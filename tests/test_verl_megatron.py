"""verl 0.9.1 Megatron actor checkpoints (tests/verl_megatron_fixtures.py: verl's own engine, mbridge
and checkpoint manager under torchrun on CPU, TP or PP = 2) through ``--plan megatron-gpt``,
checked against verl's own megatron merger (run on CPU), megatron-core's logits and
transformers' ``from_pretrained``."""

from __future__ import annotations

import json

import pytest
import torch
import verl_megatron_fixtures
from helpers import cli, fixture_root
from safetensors.torch import load_file

MERGED = [c["name"] for c in verl_megatron_fixtures.cases() if "hf_model" in c["contents"] and c["dist"]]
DIST = [c["name"] for c in verl_megatron_fixtures.cases() if c["dist"]]
ENTRIES = ["actor", "step", "run --step latest", "run"]


@pytest.fixture(scope="session")
def verl_megatron(request, tmp_path_factory) -> dict[str, dict]:
    """verl Megatron runs under torchrun, made once and kept on the machine (tests/fixture_cache.py)."""
    root = fixture_root(tmp_path_factory, "verl-megatron", *verl_megatron_fixtures.CODE)
    return verl_megatron_fixtures.make_verl_megatron_checkpoints(root)


def _source(case: dict, entry: str) -> list:
    where, *step = entry.split(" ", 1)
    return [case[where], *(step[0].split() if step else [])]


def assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want), set(got) ^ set(want)
    for name, t in got.items():
        w = want[name]
        assert t.dtype == w.dtype and t.shape == w.shape, name
        assert torch.equal(t.view(torch.uint8), w.view(torch.uint8)), name


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("name", MERGED)
def test_is_verls_megatron_merger_bit_for_bit(verl_megatron, tmp_path, name, entry):
    """The actor folder, ``global_step_N/`` and the run root (``--step latest`` or its tracker)
    all give verl's merger's tensors, with the config and tokenizer from ``model/huggingface/``
    and no ``--hf-config``."""
    case = verl_megatron[name]
    out = tmp_path / "out"
    done = cli("rewrite", *_source(case, entry), "-o", out, "--plan", "megatron-gpt", check=0)
    got = load_file(out / "model.safetensors")
    assert_bitwise(got, load_file(case["merged"] / "model.safetensors"))
    if entry == "actor":  # and the bridge's own HF export (hf_model), which it leaves out
        assert_bitwise(got, load_file(case["actor"] / "model" / "huggingface" / "model.safetensors"))
    for side in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / side).read_bytes() == (case["merged"] / side).read_bytes()
    config = json.loads((out / "config.json").read_text())
    merged = json.loads((case["merged"] / "config.json").read_text())
    assert {k: config.get(k) for k in merged if k != "transformers_version"} == {
        k: v for k, v in merged.items() if k != "transformers_version"
    }
    assert "optimizer/dist_ckpt/" in done.stderr and "extra/dist_ckpt/" in done.stderr
    assert "../data.pt" in done.stderr


@pytest.mark.parametrize("name", [c["name"] for c in verl_megatron_fixtures.cases()])
def test_loads_with_megatrons_logits(verl_megatron, tmp_path, name):
    """``from_pretrained`` with no missing or unexpected keys, and the logits of megatron-core's
    own forward of the saved model (bf16 both, within bf16 rounding). Without ``hf_model`` verl
    saved no HF config: ``--hf-config`` gives the base model's. With verl's defaults the model is
    the bridge's HF weights, read without --plan."""
    from transformers import AutoModelForCausalLM

    case = verl_megatron[name]
    given = [] if case["merged"] else ["--hf-config", case["base"] / "config.json"]
    plan = ["--plan", "megatron-gpt", *given] if case["dist"] else []  # verl's defaults: its HF weights
    cli("rewrite", case["actor"], "-o", tmp_path / "out", *plan, check=0)
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True,
                                                       attn_implementation="eager")  # fmt: skip
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    oracle = torch.load(case["oracle"], weights_only=True)
    with torch.no_grad():
        logits = model(oracle["tokens"]).logits.float()
    torch.testing.assert_close(logits, oracle["logits"], atol=3e-2, rtol=3e-2)


def test_no_hf_config_is_refused_in_one_line(verl_megatron, tmp_path):
    """verl's default contents write no ``huggingface/``: one line naming the actor and what to
    give, exit 2, nothing at the output."""
    case = verl_megatron["tp2_no_hf"]
    out = tmp_path / "out"
    done = cli("rewrite", case["run"], "-o", out, "--plan", "megatron-gpt", check=2)
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert str(case["actor"]) in done.stderr and "--hf-config" in done.stderr and "hf_model" in done.stderr
    assert not out.exists()


def test_defaults_read_the_bridges_weights(verl_megatron, tmp_path):
    """verl's defaults (no use_dist_checkpointing) save the model as the bridge's HF weights in
    ``model/huggingface/``: the run root reads them bit for bit, the optimizer, RNG and
    ``data.pt`` left out with a note; ``--plan megatron-gpt`` says in one line to drop it."""
    case = verl_megatron["tp2_default"]
    hf = case["actor"] / "model" / "huggingface"
    done = cli("rewrite", case["run"], "-o", tmp_path / "out", check=0)
    assert_bitwise(load_file(tmp_path / "out" / "model.safetensors"), load_file(hf / "model.safetensors"))
    assert "read model/huggingface/" in done.stderr and "optimizer/dist_ckpt/" in done.stderr
    refused = cli("rewrite", case["run"], "-o", tmp_path / "planned", "--plan", "megatron-gpt", check=2)
    assert refused.stderr.count("\n") == 1 and "without --plan" in refused.stderr, refused.stderr
    assert not (tmp_path / "planned").exists()


@pytest.mark.parametrize("name", DIST)
def test_dist_actor_without_plan_names_it(verl_megatron, tmp_path, name):
    """A dist-checkpoint actor rewritten without a plan: one line naming --plan megatron-gpt."""
    done = cli("rewrite", verl_megatron[name]["step"], "-o", tmp_path / "out", check=2)
    assert done.stderr.count("\n") == 1 and "--plan megatron-gpt" in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()
