"""``--plan megatron-gpt`` on what Megatron-LM's own training loop leaves behind (issue #42):
``pretrain`` from the megatron-core 0.19.2 wheel, one step, ``--ckpt-format torch_dist``, at PP=2,
PP=2 with tied embeddings, uneven PP, TP=2 x PP=2 and an MoE run (tests/megatron_train_fixtures.py,
one torchrun launch of 4 ranks). One command, no config by hand: every config value comes from the
saved args. Oracle: megatron's own fp32 forward after megatron-core's ``dist_checkpointing.load`` at
TP=1/PP=1, against transformers loading the output."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
from helpers import cli, megatron_checkpoints
from megatron_args import with_args
from megatron_train_fixtures import COMMON, RUNS, VOCAB

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.filterwarnings("ignore")

PLAN = "megatron-gpt"
STEP = "iter_0000001"


@pytest.fixture(scope="session")
def trained(request, tmp_path_factory) -> dict[str, Path]:
    return megatron_checkpoints(request, tmp_path_factory, "megatron_train_fixtures.py", "megatron-train", torchrun=4)


@pytest.fixture(scope="module")
def converted(trained, tmp_path_factory) -> dict[str, Path]:
    """Each run converted once by the one command (from its run root, nothing else given)."""
    out = tmp_path_factory.mktemp("converted")
    for name in RUNS:
        cli("rewrite", trained[name], "-o", out / name, "--plan", PLAN, "-q", check=0)
    return {name: out / name for name in RUNS}


def _flag(name: str) -> str:
    """The value the runs gave Megatron-LM's ``name`` flag."""
    return COMMON[COMMON.index(name) + 1]


def _logits(folder: Path, oracle: Path):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    data = torch.load(oracle)
    with torch.no_grad():
        return model(input_ids=data["tokens"]).logits, data["logits"]


@pytest.mark.parametrize("name", list(RUNS))
def test_one_command_matches_megatron_forward(trained, converted, name):
    """The run root, nothing else: the output loads in transformers and gives megatron's logits."""
    got, want = _logits(converted[name], trained[name] / "oracle.pt")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_config_values_are_the_runs(converted):
    """Each value as the run's flags set it (the norm epsilon Megatron-LM 0.19 saves as
    layernorm_epsilon, the RoPE base, the query groups, the head tying, the tokenizer's vocabulary
    out of the padded rows, SwiGLU)."""
    for name, tied in (("pp2", False), ("pp2_tied", True)):
        config = json.loads((converted[name] / "config.json").read_text())
        assert config["rms_norm_eps"] == float(_flag("--norm-epsilon"))
        assert config["rope_parameters"]["rope_theta"] == int(_flag("--rotary-base"))
        assert config["num_key_value_heads"] == int(_flag("--num-query-groups"))
        assert config["num_attention_heads"] == int(_flag("--num-attention-heads"))
        assert config["num_hidden_layers"] == int(_flag("--num-layers"))
        assert config["vocab_size"] == VOCAB and config["hidden_act"] == "silu"
        assert config["tie_word_embeddings"] is tied and config["model_type"] == "llama"
    config = json.loads((converted["moe_pp2"] / "config.json").read_text())
    assert config["model_type"] == "mixtral" and config["num_local_experts"] == 4 and config["intermediate_size"] == 32


def test_run_root_and_iteration_folder_agree(trained, converted, tmp_path):
    cli("rewrite", trained["pp2_uneven"] / STEP, "-o", tmp_path / "step", "--plan", PLAN, check=0)
    root, step = converted["pp2_uneven"] / "model.safetensors", tmp_path / "step" / "model.safetensors"
    assert root.read_bytes() == step.read_bytes()


def test_note_names_what_is_left_out(trained, tmp_path):
    note = cli("rewrite", trained["tp2_pp2"], "-o", tmp_path / "hf", "--plan", PLAN, "--dry-run", check=0).stderr
    for what in ("optimizer state", "exp_avg_sq", "rng_state", "rerun_state_machine_state", "every linear's "
                 "_extra_state (linear_fc1, linear_fc2, linear_proj, linear_qkv)", "opt_param_scheduler"):  # fmt: skip
        assert what in note, note


def test_hf_config_that_agrees_is_taken(trained, converted, tmp_path):
    given = tmp_path / "config.json"
    shutil.copy(converted["pp2"] / "config.json", given)
    cli("rewrite", trained["pp2"], "-o", tmp_path / "hf", "--plan", PLAN, "--hf-config", given, check=0)
    got, want = _logits(tmp_path / "hf", trained["pp2"] / "oracle.pt")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def _refused(source: Path, out: Path, *extra) -> str:
    proc = cli("rewrite", source, "-o", out, "--plan", PLAN, *extra, check=2)
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr and not out.exists(), proc.stderr
    return proc.stderr


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_hidden_layers": 3}, "num_hidden_layers is 3, the checkpoint's args say 4"),
        ({"num_attention_heads": 8, "head_dim": 8}, "num_attention_heads is 8, the checkpoint's args say 4"),
        ({"num_key_value_heads": 4}, "num_key_value_heads is 4, the checkpoint's args say 2"),
        ({"hidden_size": 128}, "hidden_size is 128, the checkpoint's args say 64"),
        ({"intermediate_size": 64}, "intermediate_size is 64, the checkpoint's args say 96"),
        ({"rms_norm_eps": 1e-5}, "rms_norm_eps is 1e-05, the checkpoint's args say 1e-06"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}, "rope_theta is 10000.0, the"),
        ({"vocab_size": 300}, "vocab_size 300 exceeds the checkpoint's 256 rows"),
        ({"tie_word_embeddings": True}, "the config ties the output head, the checkpoint has its output_layer"),
    ],
)
def test_hf_config_disagreeing_with_the_args_is_refused(trained, converted, tmp_path, change, message):
    given = tmp_path / "config.json"
    given.write_text(json.dumps({**json.loads((converted["pp2"] / "config.json").read_text()), **change}))
    assert message in _refused(trained["pp2"], tmp_path / "hf", "--hf-config", given)


def test_broken_runs_are_refused(trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained["tp2_pp2"], run)
    (run / STEP / "__3_0.distcp").unlink()
    assert f"{STEP}/__3_0.distcp: file named by .metadata is missing" in _refused(run, tmp_path / "hf")
    (run / "latest_checkpointed_iteration.txt").write_text("2")
    assert "latest_checkpointed_iteration.txt says '2', and there is no such iteration folder" in _refused(
        run, tmp_path / "hf"
    )


def test_a_vocabulary_the_rows_cannot_hold_is_refused(trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained["pp2_tied"], run)
    with_args(run, vocab_size=300)
    assert "args.vocab_size 300 exceeds args.padded_vocab_size 256" in _refused(run, tmp_path / "hf")


def test_without_a_tokenizer_size_every_padded_row_is_kept(trained, tmp_path):
    """A run with a Hugging Face tokenizer saves no args.vocab_size: the padded rows are all written,
    said in a note, and --hf-config's vocab_size trims them."""
    run = with_args(shutil.copytree(trained["pp2_tied"], tmp_path / "run"), vocab_size=None)
    proc = cli("rewrite", run, "-o", tmp_path / "hf", "--plan", PLAN, check=0)
    assert "all 256 padded rows written; --hf-config with the tokenizer's vocab_size trims them" in proc.stderr
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == 256


def test_args_saying_untied_without_a_head_is_refused(trained, tmp_path):
    """A last stage's head missing (the args untie it, no output_layer saved) is never written as tied."""
    run = tmp_path / "run"
    shutil.copytree(trained["pp2_tied"], run)
    with_args(run, untie_embeddings_and_output_weights=True)
    message = "args.untie_embeddings_and_output_weights is True, the checkpoint has no output_layer.weight"
    assert message in _refused(run, tmp_path / "hf")


def test_args_read_as_data_never_run(trained, tmp_path):
    """The saved args hold a signal.Signals, megatron's enums and torch dtypes: read as values. A
    callable under the same modules is refused by name."""
    from streamck.plan.megatron.args import read_args

    args, iteration = read_args(trained["pp2"] / STEP)
    assert iteration == 1 and args["layernorm_epsilon"] == 1e-6 and args["padded_vocab_size"] == 256
    run = tmp_path / "run"
    shutil.copytree(trained["pp2"], run)
    with_args(run, keep_config=True, exit_signal=signal.SIGTERM, params_dtype=torch.bfloat16)
    assert read_args(run / STEP)[0]["num_layers"] == 4
    with_args(run, keep_config=True, exit_signal=signal.raise_signal)
    assert "refusing to load _signal.raise_signal: not part of a tensor state dict" in _refused(run, tmp_path / "hf")
