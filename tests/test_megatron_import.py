"""``streamck rewrite HF -o RUN --format megatron`` (issue #52): a Hugging Face GPT as the run root
Megatron-LM loads. Right means Megatron's own load: megatron-core's ``dist_checkpointing.load``
(every key the model asks for there) into the model Megatron-LM's builder makes, at TP=1/PP=1 and
at TP=2 x PP=2 on 4 gloo ranks, gives transformers' logits (MHA and MQA too, a padded vocabulary
other than the run's, a BF16 run); Megatron-LM's training loop takes a step
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
from megatron_import_models import MODELS, RUNS, build, flags, logits, padded

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore")

FORMAT = ("--format", "megatron")
STEP = "iter_0000000"
TRAINED = "llama"  # the model Megatron-LM's training loop takes a step from


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Each of MODELS saved by transformers; each of RUNS written by one streamck command into ``<name>-run``."""
    root = tmp_path_factory.mktemp("hf")
    for name in MODELS:
        build(name, root / name)
    for name, (model, args, _) in RUNS.items():
        cli("rewrite", root / model, "-o", root / f"{name}-run", *FORMAT, *args, "-q", check=0)
    return {name: root / name for name in MODELS}


@pytest.fixture(scope="module")
def megatron(models, tmp_path_factory) -> Path:
    """The one torchrun launch: every run loaded at every layout of it, and the training step."""
    if not Path(MEGATRON, "megatron", "core").is_dir():
        pytest.skip(f"megatron-core 0.19.2 is not unpacked at {MEGATRON} (scripts/test does it)")
    out = tmp_path_factory.mktemp("megatron")
    root = models[TRAINED].parent
    jobs = [{"name": n, "run": str(root / f"{n}-run"), "flags": flags(model), "train": n == TRAINED,
             "layouts": layouts} for n, (model, _, layouts) in RUNS.items()]  # fmt: skip
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
    [pytest.param(n, lay, id=f"{n}-{_id(lay)}") for n, (_, _, layouts) in RUNS.items() for lay in layouts],
)
def test_megatron_loads_it_and_gives_the_hf_logits(models, megatron, name, layout):
    """megatron-core's load into Megatron-LM's own model at the layout (TP, PP, EP): transformers'
    logits (fp32, 1e-5 of their largest), and the padded vocabulary's logits exactly 0 (zero rows).
    A BF16 run (Megatron's fp32 model holding its BF16 values) against transformers' fp32 forward of
    the weights torch rounds to BF16: the same weights, so the same tolerance as fp32; the BF16
    rounding itself moves these logits by ~4e-3 of their largest, 400 times that, and the test
    checks they are not the unrounded model's."""
    model, args, _ = RUNS[name]
    saved = torch.load(megatron / f"{name}-{_id(layout)}.pt")
    vocab = MODELS[model][1]["vocab_size"]
    want = logits(models[model], saved["tokens"], bf16="bf16" in args)
    got = saved["logits"]
    assert got.shape[-1] == padded(vocab, layout[0]) and not got[..., vocab:].any()
    tolerance = {"rtol": 1e-5, "atol": 1e-5 * want.abs().max().item()}
    torch.testing.assert_close(got[..., :vocab], want, **tolerance)
    if "bf16" in args:
        assert not torch.allclose(got[..., :vocab], logits(models[model], saved["tokens"]), **tolerance)


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
    from streamck.units import human

    assert read_args(run / STEP)[0]["padded_vocab_size"] == 300
    dry = cli("rewrite", models["llama"], "-o", tmp_path / "dry", *FORMAT, "--dtype", "bf16",
              "--make-vocab-size-divisible-by", "100", "--dry-run", check=0).stdout  # fmt: skip
    zeros = 2 * (300 - 250) * 64 * 2  # the embedding's and the head's 50 padding rows of 64 BF16 values
    assert f"the padded vocabulary's zero rows add {human(zeros)} ({zeros} bytes) to the total" in dry


def _refused(*args) -> str:
    out = Path(args[args.index("-o") + 1])
    proc = cli("rewrite", *args, check=2)
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert not out.exists() or out.name == "exists"
    return proc.stderr


def _with_config(models, tmp_path, name: str = "llama", drop: tuple[str, ...] = (), **changes) -> Path:
    """MODELS[name]'s weights beside its config.json with ``changes`` made and the keys ``drop`` left out."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors").symlink_to(models[name] / "model.safetensors")
    config = json.loads((models[name] / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({k: v for k, v in {**config, **changes}.items() if k not in drop}))
    return hf


def test_a_family_without_a_table_is_refused(models, tmp_path):
    hf = _with_config(models, tmp_path, model_type="gpt2")
    message = _refused(hf, "-o", tmp_path / "run", *FORMAT)
    assert "model_type 'gpt2' has no Megatron GPTModel table" in message


def test_a_vocabulary_that_cannot_be_padded_as_asked_is_refused(models, tmp_path):
    message = _refused(models["llama"], "-o", tmp_path / "run", *FORMAT, "--make-vocab-size-divisible-by", "0")
    assert "--make-vocab-size-divisible-by 0: must be at least 1" in message
    message = _refused(models["llama"], "-o", tmp_path / "run", *FORMAT, "--make-vocab-size-divisible-by", "1000000")
    assert "--make-vocab-size-divisible-by 1000000 pads the 250-row vocabulary with 999750 zero rows" in message
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


def test_a_megatron_tensor_whose_parts_are_cast_apart_is_refused(models, tmp_path):
    """q_proj cast to F32 and k_proj to BF16 would be one linear_qkv of two dtypes; .metadata names one."""
    message = _refused(models["llama"], "-o", tmp_path / "run", *FORMAT, "--dtype", "bf16",
                       "--cast", "*q_proj.weight=F32")  # fmt: skip
    assert ("decoder.layers.self_attention.linear_qkv.weight would hold model.layers.0.self_attn.q_proj.weight as "
            "F32 and model.layers.0.self_attn.k_proj.weight as BF16") in message  # fmt: skip


def test_a_plans_own_config_goes_along(models, tmp_path):
    """A run root without config.json read by --plan megatron-gpt (which builds config.json from its
    args) and written again by --format megatron keeps that config.json; transformers reads it as the
    model's, and the new run reads back as the Hugging Face tensors."""
    from transformers import AutoConfig

    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("latest_checkpointed_iteration.txt", STEP):
        (bare / name).symlink_to(models["llama"].parent / "llama-run" / name)
    cli("rewrite", bare, "-o", tmp_path / "run", "--plan", "megatron-gpt", *FORMAT, "-q", check=0)
    got, want = (AutoConfig.from_pretrained(p).to_dict() for p in (tmp_path / "run", models["llama"]))
    assert all(got[k] == want[k] for k in ("model_type", "num_hidden_layers", "hidden_size", "vocab_size"))
    cli("rewrite", tmp_path / "run", "-o", tmp_path / "back", "--plan", "megatron-gpt", "-q", check=0)
    assert _same(_tensors(tmp_path / "back" / "model.safetensors"), _tensors(models["llama"] / "model.safetensors"))


SLIDING = [  # (model, config changes, the key the refusal names; None: no layer's window applies, written)
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2, "layer_types": None},
     "use_sliding_window"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "layer_types": ["full_attention"] * 3
               + ["sliding_attention"]}, "layer_types"),
    ("mixtral", {"sliding_window": 16}, "sliding_window"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 4, "layer_types": None}, None),
    ("mixtral", {"sliding_window": None}, None),
]  # fmt: skip


@pytest.mark.parametrize(("name", "changes", "key"), SLIDING)
def test_sliding_window_attention_is_refused(models, tmp_path, name, changes, key):
    """Megatron's GPTModel attends over the whole sequence: a window some layer has, as transformers
    reads the config, is refused naming the key that turns it on; one no layer has is written."""
    from transformers import AutoConfig

    hf = _with_config(models, tmp_path, name, **changes)
    config = AutoConfig.from_pretrained(hf)
    types = getattr(config, "layer_types", None)
    assert (key is not None) == (config.sliding_window is not None and (types is None or "sliding_attention" in types))
    if key is None:
        cli("rewrite", hf, "-o", tmp_path / "run", *FORMAT, "--dry-run", check=0)
        return
    assert f"{key} turns on sliding-window attention" in _refused(hf, "-o", tmp_path / "run", *FORMAT)


@pytest.mark.parametrize(
    ("changes", "says"),
    [({"rope_parameters": "x"}, "config.json's rope_parameters must be an object, not 'x'"),
     ({"rms_norm_eps": None}, "config.json's rms_norm_eps must be a positive number, not None"),
     ({"rope_parameters": None, "rope_theta": "abc"}, "config.json's rope_theta must be a positive number, not 'abc'"),
     ({"rope_parameters": {"rope_theta": -1.0}}, "config.json's rope_parameters.rope_theta must be a positive number"),
     ({"max_position_embeddings": 6.5}, "config.json's max_position_embeddings must be a positive integer")],
)  # fmt: skip
def test_config_values_the_args_take_are_checked(models, tmp_path, changes, says):
    hf = _with_config(models, tmp_path, **changes)
    assert says in _refused(hf, "-o", tmp_path / "run", *FORMAT)


def test_norm_topk_prob_left_out_is_the_familys_default(models, tmp_path):
    """Qwen3-MoE's config without norm_topk_prob: transformers takes False (no renormalising), so the
    args say moe_router_pre_softmax, and --plan megatron-gpt, checking them against that config,
    reads the run back as the Hugging Face tensors."""
    from transformers import AutoConfig

    from streamck.plan.megatron.args import read_args

    hf = _with_config(models, tmp_path, "qwen3_moe", drop=("norm_topk_prob",))
    assert AutoConfig.from_pretrained(hf).norm_topk_prob is False
    cli("rewrite", hf, "-o", tmp_path / "run", *FORMAT, "-q", check=0)
    assert read_args(tmp_path / "run" / STEP)[0]["moe_router_pre_softmax"] is True
    cli("rewrite", tmp_path / "run", "-o", tmp_path / "back", "--plan", "megatron-gpt", "-q", check=0)
    assert _same(_tensors(tmp_path / "back" / "model.safetensors"), _tensors(hf / "model.safetensors"))
