"""OLMo-core 3.0.0 checkpoints (issue 34): written by OLMo-core's own ``save_model_and_optim_state``
and its trainer's ``Checkpointer.save`` under torchrun (FSDP2, 2 gloo ranks: tests/olmo_fixtures.py).
Oracles: OLMo-core's ``unshard_checkpoint``, its ``load_model_and_optim_state`` + ``save_hf_model``,
and transformers' logits from the output against OLMo-core's model's."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from helpers import cli, fixture_root, missing

torch = pytest.importorskip("torch")
from safetensors.torch import load_file  # noqa: E402

HERE = Path(__file__).parent
OLMO = os.environ.get("STREAMCK_OLMO_PATH", str(HERE.parent / ".venv" / "olmo-core-3.0.0"))


@pytest.fixture(scope="session")
def olmo(request, tmp_path_factory) -> Path:
    from olmo_fixtures import make_olmo_checkpoints

    if not Path(OLMO, "olmo_core").is_dir():
        missing(f"OLMo-core 3.0.0 is not unpacked at {OLMO} (scripts/test does it)")
    root = fixture_root(tmp_path_factory, "olmo", "tests/olmo_fixtures.py", "tests/trainer_fixtures.py")
    return make_olmo_checkpoints(root, OLMO)


def _same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def test_dcp_reads_as_the_model_like_unshard_checkpoint(olmo, tmp_path):
    out = tmp_path / "m.safetensors"
    r = cli("rewrite", olmo / "dcp", "-o", out, "--verify", check=0)
    assert "read the model: 25 tensors under 'model'" in r.stderr and "--key '*' reads every group" in r.stderr
    want = {k.removeprefix("model."): v for k, v in load_file(olmo / "unshard" / "model.safetensors").items()}
    _same(load_file(out), want)
    everything = cli("ls", olmo / "dcp", "--key", "*", "--json", check=0).stdout
    assert any(k.startswith("optim.state.") for k in json.loads(everything)["tensors"])


@pytest.mark.parametrize("how", ["step", "root-latest", "root-2"])
def test_trainer_step_reads_as_the_model(olmo, tmp_path, how):
    src = {"step": [olmo / "run" / "step2"], "root-latest": [olmo / "run", "--step", "latest"],
           "root-2": [olmo / "run", "--step", "2"]}[how]  # fmt: skip
    r = cli("rewrite", *src, "-o", tmp_path / "m.safetensors", check=0)
    assert "left out beside it: train/ (the trainer's state, 2 rank files)" in r.stderr
    got = load_file(tmp_path / "m.safetensors")
    assert len(got) == 25 and not any(k.startswith("optim") for k in got)
    hf = load_file(olmo / "hf_step2" / "model.safetensors")
    assert torch.equal(got["blocks.1.attention.w_q.weight"], hf["model.layers.1.self_attn.q_proj.weight"])


def test_unfinished_step_is_refused_and_skipped_for_latest(olmo, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(olmo / "run", run)
    shutil.copytree(run / "step2", run / "step3")
    (run / "step3" / ".metadata.json").unlink()  # Checkpointer writes it last
    r = cli("ls", run / "step3")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "still being written or damaged" in r.stderr
    assert "step2/model_and_optim" in cli("ls", run, "--step", "latest", check=0).stdout


@pytest.mark.parametrize("src", ["step", "dcp", "unshard"])
def test_plan_olmo2_equals_save_hf_model(olmo, tmp_path, src):
    out = tmp_path / "hf"
    args = {"step": [olmo / "run", "--step", "latest"], "dcp": [olmo / "dcp"], "unshard": [olmo / "unshard"]}[src]
    config = [] if src == "step" else ["--hf-config", olmo / "run" / "config.json"]
    cli("rewrite", *args, "-o", out, "--plan", "olmo2", *config, check=0)
    oracle = olmo / ("hf_step2" if src == "step" else "hf_dcp")
    _same(load_file(out / "model.safetensors"), load_file(oracle / "model.safetensors"))
    want, got = json.loads((oracle / "config.json").read_text()), json.loads((out / "config.json").read_text())
    written = {k: v for k, v in got.items() if k != "rope_theta"}  # rope_theta: for transformers 4 readers
    assert {k: want[k] for k in written} == written


def test_plan_olmo2_logits_in_transformers(olmo, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    cli("rewrite", olmo / "run", "--step", "latest", "-o", out, "--plan", "olmo2", check=0)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__name__ == "Olmo2ForCausalLM"
    with torch.no_grad():
        logits = model(torch.load(olmo / "tokens.pt")).logits
    torch.testing.assert_close(logits, torch.load(olmo / "logits.pt"), rtol=1e-5, atol=1e-5)


def test_plan_olmo2_refusals(olmo, tmp_path):
    cfg = json.loads((olmo / "run" / "config.json").read_text())
    cfg["model"]["n_layers"] = 3
    (tmp_path / "three.json").write_text(json.dumps(cfg))
    cfg["model"]["n_layers"], cfg["model"]["block"]["name"] = 2, "default"
    (tmp_path / "llama.json").write_text(json.dumps(cfg))
    for config, said in (("three.json", "1 missing"), ("llama.json", "not an OLMo 2 model config")):
        r = cli("rewrite", olmo / "dcp", "-o", tmp_path / "o", "--plan", "olmo2", "--hf-config", tmp_path / config)
        assert r.returncode == 2 and said in r.stderr and r.stderr.count("\n") == 1, r.stderr
        assert not (tmp_path / "o").exists()
