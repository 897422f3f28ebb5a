"""``--plan torchtitan-llama3`` on steps torchtitan 0.3.0's own CheckpointManager wrote
(FSDP2, 2 gloo ranks: bench/titan_ckpt.py). Oracles: torchtitan's convert_to_hf
(its StateDictAdapter.to_hf on the dcp.load-ed state) tensor for tensor, and the
trainer's own forward against transformers loading the output with from_pretrained."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import cli, says_the_plan, titan_checkpoints

torch = pytest.importorskip("torch")
pytest.importorskip("torchtitan", reason="torchtitan==0.3.0 (scripts/test installs it)")

HERE = Path(__file__).parent
BENCH = HERE.parent / "bench"  # the trainers' own checkpointing code, shared with the bench
PLAN = "torchtitan-llama3"


@pytest.fixture(scope="session")
def titan(request, tmp_path_factory) -> dict[str, Path]:
    """The fixture folders by model name, built once per fixture-script version (cached)."""
    return titan_checkpoints(tmp_path_factory)


def _rewrite(case: Path, out: Path, *extra: str, check: int = 0):
    step = case / "checkpoint" / "step-1"
    return cli("rewrite", step, "-o", out, "--plan", PLAN, "--hf-config", case / "config.json", *extra, check=check)


def _load(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


@pytest.mark.parametrize("name", ["llama3", "llama3_tied", "qwen3", "llama3_v02"])
def test_same_tensors_as_convert_to_hf(titan, tmp_path, name):
    case = titan[name]
    _rewrite(case, tmp_path / "hf")
    got, want = _load(tmp_path / "hf" / "model.safetensors"), _load(case / "convert_to_hf.safetensors")
    if json.loads((case / "config.json").read_text())["tie_word_embeddings"]:
        assert "lm_head.weight" not in got  # what save_pretrained writes for a tied head
        want.pop("lm_head.weight", None)
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("name", ["llama3", "llama3_tied", "qwen3"])
def test_logits_match_the_trainer(titan, tmp_path, name):
    """transformers, from the output folder alone (weights + the config.json written), gives
    the logits the trainer's FSDP2 model gave."""
    from transformers import AutoModelForCausalLM

    _rewrite(titan[name], tmp_path / "hf")
    oracle = torch.load(titan[name] / "oracle.pt")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        logits = model(oracle["tokens"]).logits
    torch.testing.assert_close(logits, oracle["logits"], rtol=0, atol=1e-5)


def test_unpermuted_q_k_would_be_wrong(titan, tmp_path):
    """The control: the same weights renamed only (no RoPE reordering) load without a word
    and give logits off by far more than the tolerance above; so that test can tell."""
    from transformers import AutoModelForCausalLM

    case = titan["llama3"]
    _rewrite(case, tmp_path / "hf")
    wrong = _load(case / "convert_to_hf.safetensors")
    for k in [k for k in wrong if k.endswith(("q_proj.weight", "k_proj.weight"))]:
        heads = 4 if "q_proj" in k else 2
        w = wrong[k]  # undo the adapter's permutation: back to torchtitan's row order
        wrong[k] = w.view(heads, 2, w.shape[0] // heads // 2, -1).transpose(1, 2).reshape(w.shape).contiguous()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    model.load_state_dict(wrong)
    oracle = torch.load(case / "oracle.pt")
    with torch.no_grad():
        assert (model(oracle["tokens"]).logits - oracle["logits"]).abs().max() > 1e-3


def test_dtype_follows_cast(titan, tmp_path):
    case = titan["qwen3"]
    _rewrite(case, tmp_path / "hf", "--dtype", "bf16")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    got, want = _load(tmp_path / "hf" / "model.safetensors"), _load(case / "convert_to_hf.safetensors")
    for k, v in got.items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, want[k].to(torch.bfloat16)), k


def test_config_beside_the_step_and_dry_run(titan, tmp_path):
    case = tmp_path / "run"
    shutil.copytree(titan["llama3"] / "checkpoint", case / "checkpoint")
    shutil.copy(titan["llama3"] / "config.json", case / "checkpoint" / "config.json")
    step = case / "checkpoint" / "step-1"
    proc = cli("rewrite", step, "-o", tmp_path / "hf", "--plan", PLAN, "--dry-run", check=0)
    assert "torchtitan 0.3 llama: L=2, H=64, nh=4, nkv=2, d=16, I=96, V=256" in proc.stdout
    assert "RoPE pairs to halves" in proc.stdout and not (tmp_path / "hf").exists()
    proc = cli("rewrite", case / "checkpoint", "-o", tmp_path / "hf", "--plan", PLAN, check=2)
    assert "holds torchtitan steps (step-1): give one of them" in proc.stderr


def _edited(case: Path, tmp: Path, **changes) -> Path:
    config = json.loads((case / "config.json").read_text())
    config.update(changes)
    path = tmp / "config.json"
    path.write_text(json.dumps(config))
    return path


REFUSED = [
    ("llama3", {"hidden_size": 32, "head_dim": 8}, "tok_embeddings.weight has shape [256, 64], expected [256, 32]"),
    ("llama3", {"num_hidden_layers": 3}, "9 missing: layers.2.attention.qkv_linear.wk.weight"),
    ("llama3", {"num_key_value_heads": 4}, "wk.weight has shape [32, 64], expected [64, 64]"),
    ("llama3", {"model_type": "mistral"}, "model_type 'mistral': --plan torchtitan converts llama, qwen3"),
    ("llama3", {"tie_word_embeddings": True}, "lm_head.weight is not tok_embeddings.weight in this checkpoint"),
    ("llama3", {"intermediate_size": "96"}, "intermediate_size must be a positive integer, not '96'"),
    ("qwen3", {"model_type": "llama"}, "has q_norm/k_norm weights, but the config's model_type is 'llama'"),
    ("llama3", {"attention_bias": True}, "attention_bias: true, but torchtitan's llama has no biases"),
]


@pytest.mark.parametrize(("name", "changes", "message"), REFUSED)
def test_refused_before_writing(titan, tmp_path, name, changes, message):
    config = _edited(titan[name], tmp_path, **changes)
    step = titan[name] / "checkpoint" / "step-1"
    out = tmp_path / "hf"
    proc = cli("rewrite", step, "-o", out, "--plan", PLAN, "--hf-config", config, check=2)
    assert message in proc.stderr and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert not out.exists()


def test_refused_arguments(titan, tmp_path):
    step = titan["llama3"] / "checkpoint" / "step-1"
    proc = cli("rewrite", step, "-o", tmp_path / "hf", "--plan", PLAN, check=2)
    assert "needs the model's Hugging Face config.json for its sizes: give --hf-config FILE" in proc.stderr
    proc = cli("rewrite", step, "-o", tmp_path / "hf", "--hf-config", titan["llama3"] / "config.json", check=2)
    assert "--hf-config applies to --plan" in proc.stderr
    proc = _rewrite(titan["llama3"], tmp_path / "hf", "--strip-prefix", "model.", check=2)
    assert "cannot be combined with strip_prefix rules" in proc.stderr
    proc = cli("rewrite", titan["llama3"] / "convert_to_hf.safetensors", "-o", tmp_path / "hf", "--plan", PLAN,
               "--hf-config", titan["llama3"] / "config.json", check=2)  # fmt: skip
    assert "is not a torchtitan step" in proc.stderr
    assert not (tmp_path / "hf").exists()


def test_source_options_are_refused(titan, tmp_path):
    """The plan opens the step itself: --key, --zero and --keep-tied would be ignored."""
    proc = _rewrite(titan["llama3"], tmp_path / "hf", "--key", "model", check=2)
    assert "--key, --zero and --keep-tied do not apply to --plan torchtitan-llama3, which opens its own source" in (
        proc.stderr
    )


def test_steps_listed_by_number(titan, tmp_path):
    """A checkpoint folder's steps are named in the order torchtitan wrote them, the
    latest last (step-10 after step-9), as the hint to give one of them."""
    folder = tmp_path / "checkpoint"
    for n in (2, 10, 9):
        shutil.copytree(titan["llama3"] / "checkpoint" / "step-1", folder / f"step-{n}")
    proc = cli("rewrite", folder, "-o", tmp_path / "hf", "--plan", PLAN, check=2)
    assert f"holds torchtitan steps (step-2, step-9, step-10): give one of them, e.g. {folder / 'step-10'}" in (
        proc.stderr
    )


def test_tied_head_differing_after_64_kib_is_refused(tmp_path):
    """A head equal to the embedding in its first 64 KiB, not in its last row, is not tied."""
    import numpy as np
    from safetensors.numpy import save_file

    from streamck.errors import PlanError
    from streamck.plan.torchtitan.plan import _same_head
    from streamck.source import open_checkpoint

    embed = np.random.default_rng(0).standard_normal((1024, 64), dtype=np.float32)  # 256 KiB
    head = embed.copy()
    head[-1, -1] += 1
    save_file({"tok_embeddings.weight": embed, "output.weight": head, "same": embed.copy()}, tmp_path / "m.safetensors")
    refs = open_checkpoint(tmp_path / "m.safetensors").tensors
    _same_head(refs["same"], refs["tok_embeddings.weight"], tmp_path / "config.json")
    with pytest.raises(PlanError, match="output.weight is not tok_embeddings.weight in this checkpoint"):
        _same_head(refs["output.weight"], refs["tok_embeddings.weight"], tmp_path / "config.json")


def test_without_the_plan_a_note_names_it(titan):
    """Issue #36: a torchtitan step rewritten or listed without --plan names the plan."""
    for name in ("llama3", "llama3_v02", "qwen3"):
        says_the_plan(titan[name] / "checkpoint" / "step-1", "torchtitan", "--hf-config", titan[name] / "config.json")
