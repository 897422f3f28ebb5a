"""``streamck rewrite HF -o RUN --format megatron`` (issue #52): a Hugging Face GPT as the run root
Megatron-LM loads. Right means Megatron's own load: megatron-core's ``dist_checkpointing.load``
(every key the model asks for there) into the model Megatron-LM's builder makes, at TP=1/PP=1 and
at TP=2 x PP=2 on 4 gloo ranks, gives transformers' logits; Megatron-LM's training loop takes a step
from ``--load RUN --finetune``; and streamck's own ``--plan megatron-gpt`` read of RUN gives the
Hugging Face tensors back bit for bit. One torchrun launch for every model and layout
(tests/megatron_import_child.py); the models are transformers' own (tests/megatron_import_models.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import MEGATRON, REPO, cli
from megatron_import_models import LAYOUTS, MODELS, build, flags, logits

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore")

FORMAT = ("--format", "megatron")
STEP = "iter_0000000"
DENSE = ((1, 1, 1), (2, 2, 1))  # (TP, PP, EP) a dense model is loaded at; LAYOUTS names the MoE model's
TRAINED = "llama"  # the model Megatron-LM's training loop takes a step from


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Each of MODELS saved by transformers, then written by one streamck command into ``<name>-run``."""
    root = tmp_path_factory.mktemp("hf")
    for name in MODELS:
        build(name, root / name)
        cli("rewrite", root / name, "-o", root / f"{name}-run", *FORMAT, "-q", check=0)
    return {name: root / name for name in MODELS}


@pytest.fixture(scope="module")
def megatron(models, tmp_path_factory) -> Path:
    """The one torchrun launch: every model loaded at every layout, and the training step."""
    if not Path(MEGATRON, "megatron", "core").is_dir():
        pytest.skip(f"megatron-core 0.19.2 is not unpacked at {MEGATRON} (scripts/test does it)")
    out = tmp_path_factory.mktemp("megatron")
    jobs = [{"name": n, "run": str(p.parent / f"{n}-run"), "flags": flags(n), "train": n == TRAINED,
             "layouts": LAYOUTS.get(n, DENSE)} for n, p in models.items()]  # fmt: skip
    (out / "jobs.json").write_text(json.dumps(jobs))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": MEGATRON}
    ranks = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    command = ["timeout", "900", sys.executable, *ranks, str(REPO / "tests" / "megatron_import_child.py")]
    done = subprocess.run([*command, str(out / "jobs.json"), str(out)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-6000:]
    return out


def _tensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def _same(got: dict, want: dict) -> bool:
    """The same names, and each tensor the same dtype, shape and bytes."""
    return sorted(got) == sorted(want) and all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k])
                                               for k in want)  # fmt: skip


def _id(layout: tuple[int, int, int]) -> str:
    return "tp{}pp{}ep{}".format(*layout)


@pytest.mark.parametrize(
    ("name", "layout"),
    [pytest.param(n, lay, id=f"{n}-{_id(lay)}") for n in MODELS for lay in LAYOUTS.get(n, DENSE)],
)
def test_megatron_loads_it_and_gives_the_hf_logits(models, megatron, name, layout):
    """megatron-core's load into Megatron-LM's own model at the layout (TP, PP, EP): transformers'
    logits (fp32, 1e-5 of their largest), and the padded vocabulary's logits exactly 0 (zero rows)."""
    saved = torch.load(megatron / f"{name}-{_id(layout)}.pt")
    vocab = MODELS[name][1]["vocab_size"]
    want = logits(models[name], saved["tokens"])
    got = saved["logits"]
    assert got.shape[-1] == 256 and not got[..., vocab:].any()
    torch.testing.assert_close(got[..., :vocab], want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_a_training_step_runs_from_it(models, megatron):
    """pretrain_gpt.py's loop at TP=2 x PP=2 with --load RUN --finetune takes a step (learning rate 0)
    and saves iteration 1, whose weights, read back by streamck, are the Hugging Face ones bit for bit:
    the run started from the import, not from its own initialisation."""
    trained = megatron / f"{TRAINED}-trained"
    assert (trained / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    back = megatron / "trained-hf"
    cli("rewrite", trained, "-o", back, "--plan", "megatron-gpt", "-q", check=0)
    assert _same(_tensors(back / "model.safetensors"), _tensors(models[TRAINED] / "model.safetensors"))


@pytest.mark.parametrize("name", list(MODELS))
def test_plan_megatron_gpt_reads_the_hf_tensors_back(models, tmp_path, name):
    """streamck's own reader of Megatron checkpoints gives every Hugging Face tensor back bit for bit."""
    run = models[name].parent / f"{name}-run"
    cli("rewrite", run, "-o", tmp_path / "back", "--plan", "megatron-gpt", "-q", check=0)
    assert _same(_tensors(tmp_path / "back" / "model.safetensors"), _tensors(models[name] / "model.safetensors"))


def test_the_run_root_as_megatron_lays_it_out(models):
    """Tracker file, iteration folder, metadata.json, .metadata, .distcp; the args the run records."""
    from streamck.plan.megatron.args import read_common

    run = models["qwen3"].parent / "qwen3-run"
    assert (run / "latest_checkpointed_iteration.txt").read_text() == "0"
    assert json.loads((run / STEP / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    assert sorted(p.name for p in (run / STEP).iterdir()) == [".metadata", "__0_0.distcp", "metadata.json"]
    common = read_common(run / STEP)
    config = MODELS["qwen3"][1]
    assert common.iteration == 0 and common.args["padded_vocab_size"] == 256 and common.args["qk_layernorm"]
    assert common.args["kv_channels"] == config["head_dim"] and common.args["num_query_groups"] == 2
    assert common.args["no_save_optim"] and common.args["no_save_rng"]
    assert (run / "config.json").is_file()


def test_a_cast_and_a_split_read_back_as_the_cast_model(models, tmp_path):
    """--dtype bf16 writes bf16 chunks, --max-shard-size several .distcp files: read back, the
    tensors streamck's safetensors cast writes, and another divisor pads to its multiple."""
    cli("rewrite", models["llama"], "-o", tmp_path / "cast.safetensors", "--dtype", "bf16", "-q", check=0)
    run = tmp_path / "run"
    cli("rewrite", models["llama"], "-o", run, *FORMAT, "--dtype", "bf16", "--max-shard-size", "100KB",
        "--make-vocab-size-divisible-by", "100", "-q", check=0)  # fmt: skip
    assert len(list((run / STEP).glob("__*_0.distcp"))) > 1
    cli("rewrite", run, "-o", tmp_path / "back", "--plan", "megatron-gpt", "-q", check=0)
    assert _same(_tensors(tmp_path / "back" / "model.safetensors"), _tensors(tmp_path / "cast.safetensors"))
    from streamck.plan.megatron.args import read_args

    assert read_args(run / STEP)[0]["padded_vocab_size"] == 300


def _refused(*args) -> str:
    out = Path(args[args.index("-o") + 1])
    proc = cli("rewrite", *args, check=2)
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert not out.exists() or out.name == "exists"
    return proc.stderr


def _with_config(models, tmp_path, **changes) -> Path:
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors").symlink_to(models["llama"] / "model.safetensors")
    config = json.loads((models["llama"] / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, **changes}))
    return hf


def test_a_family_without_a_table_is_refused(models, tmp_path):
    hf = _with_config(models, tmp_path, model_type="gpt2")
    message = _refused(hf, "-o", tmp_path / "run", *FORMAT)
    assert "model_type 'gpt2' has no Megatron GPTModel table" in message


def test_a_vocabulary_that_cannot_be_padded_as_asked_is_refused(models, tmp_path):
    message = _refused(models["llama"], "-o", tmp_path / "run", *FORMAT, "--make-vocab-size-divisible-by", "0")
    assert "--make-vocab-size-divisible-by 0: must be at least 1" in message
    hf = _with_config(models, tmp_path, vocab_size=260)  # the embedding holds 250 rows
    message = _refused(hf, "-o", tmp_path / "run", *FORMAT)
    assert "model.embed_tokens.weight has shape [250, 64], expected [260, 64]" in message


def test_an_existing_run_without_force_is_refused(models, tmp_path):
    run = tmp_path / "exists"
    run.mkdir()
    (run / "mine.txt").write_text("kept")
    message = _refused(models["llama"], "-o", run, *FORMAT)
    assert "--force" in message and (run / "mine.txt").read_text() == "kept" and len(list(run.iterdir())) == 1
    cli("rewrite", models["llama"], "-o", run, *FORMAT, "--force", "-q", check=0)
    assert (run / STEP / ".metadata").is_file()


def test_a_tied_head_saved_anyway_is_left_out(models, tmp_path):
    """A tied model whose file holds lm_head.weight too: Megatron keeps one tensor (transformers ties
    the head to the embedding on load), so the run reads back as the model without it."""
    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    hf.mkdir()
    tensors = _tensors(models["llama_tied"] / "model.safetensors")
    save_file({**tensors, "lm_head.weight": torch.zeros_like(tensors["model.embed_tokens.weight"])},
              str(hf / "model.safetensors"), metadata={"format": "pt"})  # fmt: skip
    (hf / "config.json").write_text((models["llama_tied"] / "config.json").read_text())
    dry = cli("rewrite", hf, "-o", tmp_path / "run", *FORMAT, "--dry-run", check=0).stdout
    assert "lm_head.weight left out: the config ties the head to the embedding" in dry
    cli("rewrite", hf, "-o", tmp_path / "run", *FORMAT, "-q", check=0)
    cli("rewrite", tmp_path / "run", "-o", tmp_path / "back", "--plan", "megatron-gpt", "-q", check=0)
    assert _same(_tensors(tmp_path / "back" / "model.safetensors"), tensors)
