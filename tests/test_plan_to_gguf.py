"""GGUF and MLX output straight from a trainer's step through a built-in plan (#50, #51 item 1):
``streamck rewrite STEP -o model.gguf --plan torchtitan --hf-config DIR`` (or ``DIR/config.json``; and
``--format mlx``) writes, byte for byte, what the two steps write: ``-o hf`` with the plan, the
tokenizer copied beside its config.json, then ``streamck rewrite hf -o model.gguf``. The two-step
path is the one tests/test_gguf_train.py and tests/test_mlx.py check against the references; here
the GGUF is also the reference converter's own file of the model, llama.cpp runs the Llama one
against transformers' logits of the Hugging Face export, and mlx_lm loads the MLX one.

The steps are the tiny GGUF and MLX models' weights under torchtitan 0.3's names, saved by
torch.distributed.checkpoint in this process (no producer run), as test_gguf_train does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from gguf_env import logprob_deltas, run_llama_cpp
from gguf_models import reference_file, tiny_model
from helpers import cli

torch = pytest.importorskip("torch")

# What a user copies beside the plan's export: the tokenizer's files and the generation config.
TOKENIZER = ("generation_config.json", "tokenizer.json", "tokenizer_config.json")
PROMPT = [9906, 1917, 11, 1268, 527, 499, 30]  # a few ids of the Llama 3 vocabulary


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """The tiny GGUF Llama 3 and Qwen3 (tests/gguf_models.py), folders named ``model``."""
    return {kind: tiny_model(tmp_path_factory, kind) for kind in ("llama", "qwen3")}


def titan_step(model: Path, step: Path) -> Path:
    """``model``'s weights as a torchtitan 0.3 step (its names; Llama's q/k rows in RoPE pairs,
    the inverse of the plan's pairs-to-halves), saved by DCP in one process into ``step``."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from streamck.plan.torchtitan.layout import FAMILIES, HEAD, LAYER, QK_NORM, TOP

    config = json.loads((model / "config.json").read_text())
    permute, norms = FAMILIES[config["model_type"]]
    hf = load_file(model / "model.safetensors")
    layer = (*LAYER, *(QK_NORM if norms else ()))
    rows = [*TOP, *(r.at(i=i) for i in range(config["num_hidden_layers"]) for r in layer)]
    rows += [] if config.get("tie_word_embeddings") else [HEAD]
    heads = {"q": config["num_attention_heads"], "k": config["num_key_value_heads"]}
    state = {}
    for r in rows:
        w = hf[r.out]
        if permute and r.permute:  # halves to pairs: row h*hd + 2*j + a is HF's h*hd + a*hd/2 + j
            n = heads[r.permute]
            w = w.view(n, 2, w.shape[0] // n // 2, w.shape[1]).transpose(1, 2).reshape(w.shape).contiguous()
        state[r.src] = w
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=step)
    return step


def two_steps(step: Path, model: Path, out: Path, **options) -> Path:
    """The path that needs no plan support: ``-o`` a folder named as the model's with the plan,
    the tokenizer copied beside, then that folder to ``out`` (``options``: the format's)."""
    import streamck

    hf = out.parent / "two-steps" / model.name
    streamck.rewrite(step, hf, plan="torchtitan", hf_config=model / "config.json")
    for name in TOKENIZER:
        shutil.copy(model / name, hf / name)
    streamck.rewrite(hf, out, **options)
    return hf


def test_a_torchtitan_step_is_the_references_gguf_in_one_command(models, tmp_path):
    """Qwen3 to bf16, ``--hf-config`` the model's folder: the one command's file is the two steps'
    and the reference's of the model (the name is the tokenizer folder's, ``model``, as the
    reference's is its folder's)."""
    step = titan_step(models["qwen3"], tmp_path / "checkpoint" / "step-10")
    out = tmp_path / "one.gguf"
    cli("rewrite", step, "-o", out, "-q", "--plan", "torchtitan", "--hf-config", models["qwen3"], check=0)
    two_steps(step, models["qwen3"], tmp_path / "two.gguf")
    assert out.read_bytes() == (tmp_path / "two.gguf").read_bytes()
    assert out.read_bytes() == reference_file(models["qwen3"], "bf16").read_bytes()


def test_a_torchtitan_llama_runs_in_llama_cpp_as_its_export_in_transformers(models, tmp_path):
    """Llama 3 (q/k rows: pairs to halves by the plan, then the reference's permutation, which
    undo each other) to bf16 and Q8_0: each file the reference's, the bf16 one the two steps';
    llama.cpp's log-probabilities of the bf16 one within test_gguf.py's bf16 tolerance of
    transformers running the plan's Hugging Face export."""
    import streamck

    model = models["llama"]
    step = titan_step(model, tmp_path / "checkpoint" / "step-10")
    files = {}
    for outtype, options in (("q8_0", {"quantize": "Q8_0"}), ("bf16", {"dtype": "bf16"})):
        files[outtype] = tmp_path / f"one-{outtype}.gguf"
        streamck.rewrite(step, files[outtype], plan="torchtitan", hf_config=model / "config.json", **options)
        assert files[outtype].read_bytes() == reference_file(model, outtype).read_bytes(), outtype
    hf = two_steps(step, model, tmp_path / "two" / "model.gguf", dtype="bf16")
    assert files["bf16"].read_bytes() == (tmp_path / "two" / "model.gguf").read_bytes()
    run = run_llama_cpp(files["bf16"], PROMPT)
    worst, agree = logprob_deltas(hf, PROMPT, run)
    assert len(run["tokens"]) == 8 and worst < 0.06, (worst, agree)


@pytest.mark.parametrize("fmt", ["gguf", "mlx"])
def test_no_tokenizer_is_refused_in_one_line(models, tmp_path, fmt):
    """A config with no tokenizer beside it, nor beside the step: one line naming what is
    missing and where it looked, exit 2, nothing written; the plan itself takes the step."""
    step = titan_step(models["qwen3"], tmp_path / "checkpoint" / "step-10")
    config = tmp_path / "config-only" / "config.json"
    config.parent.mkdir()
    shutil.copy(models["qwen3"] / "config.json", config)
    out = tmp_path / ("out.gguf" if fmt == "gguf" else "out")
    args = ("rewrite", step, "-o", out, "--plan", "torchtitan", "--hf-config", config)
    proc = cli(*args, *(["--format", "mlx"] if fmt == "mlx" else []), check=2)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("streamck: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "needs the model's tokenizer (tokenizer.json or tokenizer.model)" in errors[0], errors[0]
    assert str(config.parent) in errors[0] and "give --hf-config the model's Hugging Face folder" in errors[0], errors[
        0
    ]
    assert not out.exists() and not list(tmp_path.glob("out*"))
    cli(*args[:3], tmp_path / "hf", *args[4:], check=0)  # the refusal is the format's, not the plan's


def _index(rows) -> list[int]:
    """``rows``' source rows in output order, as numpy indexes them."""
    import itertools

    return [rows.start + sum(i * s for i, s in zip(idx, rows.steps, strict=True))
            for idx in itertools.product(*map(range, rows.counts))]  # fmt: skip


@pytest.mark.parametrize("kind", ["plain", "rows", "last", "both", "flat", "strided"])
def test_the_references_rows_of_torchtitans_rows_read_as_numpy_indexes_them(tmp_path, kind):
    """streamck.source.select of rows of a gathered tensor (the GGUF pass's q/k order of the
    torchtitan plan's pairs-to-halves rows) over every way a source stores a tensor, read every
    way the reader reads; a plain tensor's two permutations undo each other into one range.
    Another order (every third row) is read as numpy reads it too."""
    from test_titan_select import M, _check, _sources, _strided

    from streamck.source.select import Rows, select

    ref = {**_sources(tmp_path, M), "strided": _strided(tmp_path, M)}[kind]
    heads, hd = 4, 6
    titan = Rows.rope_halves(heads, hd)
    gguf = Rows(0, (heads, hd // 2, 2), (hd, 1, hd // 2))
    both = select(select(ref, titan), gguf)
    _check(tmp_path, both, M[_index(titan)][_index(gguf)])
    np = pytest.importorskip("numpy")
    np.testing.assert_array_equal(M[_index(titan)][_index(gguf)], M)  # the two undo each other
    if kind == "plain":
        assert both.parts is None and both.strides is None, both
    thirds = Rows(1, (2, 4), (12, 3))
    _check(tmp_path, select(select(ref, titan), thirds), M[_index(titan)][_index(thirds)])


@pytest.fixture(scope="module")
def mlx_llama(tmp_path_factory) -> Path:
    """The tiny MLX Llama (tests/mlx_models.py: bf16, a 258-token byte-level tokenizer)."""
    from mlx_models import model_folder

    return model_folder(tmp_path_factory, "llama")


MLX_TOKENS = [256, 72, 101, 108, 108, 111, 44, 32, 50, 51]  # test_mlx.py's: BOS, then "Hello, 23"


def _same_folders(a: Path, b: Path) -> None:
    """Both folders hold the same files, byte for byte."""
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_a_torchtitan_step_to_mlx_in_one_command_is_mlx_lm_converts(mlx_llama, tmp_path):
    """Llama (q/k rows permuted by the plan), bf16 and MLX_Q4: the one command's folder is the
    two steps', file for file; mlx_lm.convert of the plan's Hugging Face export (the tokenizer
    beside) has the same tensors and config, and mlx_lm.load runs both to the same logits."""
    from mlx_env import run_jobs

    import streamck

    step = titan_step(mlx_llama, tmp_path / "checkpoint" / "step-10")
    jobs = []
    for case, options, convert in (("bf16", {}, {}), ("q4", {"quantize": "MLX_Q4"}, {"quantize": True})):
        one = tmp_path / f"one-{case}"
        streamck.rewrite(step, one, plan="torchtitan", hf_config=mlx_llama / "config.json", format="mlx", **options)
        hf = two_steps(step, mlx_llama, tmp_path / f"two-{case}" / "mlx", format="mlx", **options)
        _same_folders(one, tmp_path / f"two-{case}" / "mlx")
        ref = tmp_path / f"mlx_lm-{case}"
        jobs += [{"op": "convert", "src": str(hf), "dst": str(ref), **convert},
                 {"op": "compare", "a": str(one), "b": str(ref)},
                 {"op": "logits", "paths": [str(one), str(ref)], "tokens": MLX_TOKENS}]  # fmt: skip
    answers = run_jobs(jobs)
    for convert, compare, logits in zip(answers[::3], answers[1::3], answers[2::3], strict=True):
        assert "error" not in convert and "error" not in compare and "error" not in logits, answers
        assert compare["only_a"] == compare["only_b"] == compare["differ"] == [] and compare["count"] > 0, compare
        assert compare["config_equal"] and compare["index_equal"], compare
        assert logits["max_diff"] == 0.0 and logits["shape"] == [len(MLX_TOKENS), 320], logits


@pytest.fixture(scope="module")
def megatron_gpt(tmp_path_factory) -> Path:
    """tests/test_megatron.py's ``gpt`` run (megatron-core's own TP=2 save of a tiny Llama, float32,
    and its forward's logits in oracle.pt), the same cached fixture."""
    import os

    from fixture_cache import fixture_root
    from helpers import MEGATRON, missing, script_checkpoints

    bench = Path(__file__).resolve().parents[1] / "bench"
    code = (bench / "megatron_ckpt.py", bench / "standins.py")
    base = fixture_root(tmp_path_factory, "megatron", *code) / "megatron"
    if not (base / "done").exists() and not Path(MEGATRON, "megatron", "core").is_dir():
        missing(f"megatron-core 0.19.2 is not unpacked at {MEGATRON} (scripts/test does it)")
    path = os.pathsep.join([str(bench), MEGATRON, os.environ.get("PYTHONPATH", "")])
    return script_checkpoints(tmp_path_factory, "megatron", *code, env={"PYTHONPATH": path})["gpt"]


def test_a_megatron_run_to_mlx_takes_its_config_from_the_args_and_the_tokenizer_beside(megatron_gpt, mlx_llama,
                                                                                      tmp_path):  # fmt: skip
    """A Megatron-LM run with no config.json, a tokenizer beside its iteration folder: the config
    the plan builds from the run's args, the tokenizer from the run's folder; the one command's
    folder is the two steps', and mlx_lm.load runs it to megatron-core's own logits."""
    import torch
    from mlx_env import run_jobs

    import streamck

    run = tmp_path / "run"
    shutil.copytree(megatron_gpt / "iter_0000010", run / "iter_0000010")
    shutil.copy(megatron_gpt / "latest_checkpointed_iteration.txt", run)
    for name in TOKENIZER:
        shutil.copy(mlx_llama / name, run / name)
    one = tmp_path / "one"
    streamck.rewrite(run, one, plan="megatron-gpt", format="mlx")
    hf = tmp_path / "two" / "hf"
    streamck.rewrite(run, hf, plan="megatron-gpt")
    assert not (hf / "tokenizer.json").exists()  # the export alone: the tokenizer is what the one command adds
    for name in TOKENIZER:
        shutil.copy(run / name, hf / name)
    streamck.rewrite(hf, tmp_path / "two" / "mlx", format="mlx")
    _same_folders(one, tmp_path / "two" / "mlx")
    oracle = torch.load(megatron_gpt / "oracle.pt")
    tokens = oracle["tokens"][0].tolist()
    [answer] = run_jobs([{"op": "logits", "paths": [str(one)], "tokens": tokens, "save": str(tmp_path / "l.npy")}])
    assert "error" not in answer, answer
    import numpy as np

    got, want = np.load(tmp_path / "l.npy"), oracle["logits"][0].numpy()
    assert got.shape[0] == want.shape[0] and got.shape[1] >= want.shape[1], (got.shape, want.shape)
    np.testing.assert_allclose(got[:, : want.shape[1]], want, rtol=0, atol=1e-4)
