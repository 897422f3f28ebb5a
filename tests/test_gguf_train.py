"""GGUF output from a training checkpoint (#50 item 1): a PyTorch DCP save (what FSDP2's
``dcp.save`` writes) with the model's config and tokenizer beside it gives the reference's file
of the same weights; a built-in plan's export (torchtitan, with ``hf_config``) is refused in one
line saying what to do instead; --hf-config without such a plan is refused as before."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from gguf_env import write_gguf
from gguf_models import reference_file, tiny_model

SIDE = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Path:
    return tiny_model(tmp_path_factory, "qwen3")


def _dcp(tensors: dict, step: Path) -> Path:
    """``tensors`` saved by torch.distributed.checkpoint in one process (as FSDP2 saves a model,
    each rank's shards merged), in folder ``step``."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(tensors, checkpoint_id=step)
    return step


def test_a_dcp_save_with_its_config_beside_is_the_references_file(qwen3, tmp_path):
    """The tiny Qwen3's weights as a DCP step in a folder named as the model's (the folder's
    name is ``general.name``), config and tokenizer beside: the reference's bf16 file of the
    Hugging Face folder, byte for byte."""
    from safetensors.torch import load_file

    step = _dcp(load_file(qwen3 / "model.safetensors"), tmp_path / "model")
    for name in SIDE:
        shutil.copy(qwen3 / name, step / name)
    out = write_gguf(step, tmp_path / "out.gguf")[0]
    assert out.read_bytes() == reference_file(qwen3, "bf16").read_bytes()


def test_a_dcp_save_without_its_config_is_refused_in_one_line(qwen3, tmp_path):
    from helpers import cli
    from safetensors.torch import load_file

    step = _dcp(load_file(qwen3 / "model.safetensors"), tmp_path / "step-1")
    proc = cli("rewrite", step, "-o", tmp_path / "out.gguf", check=2)
    assert "GGUF output needs the model's config.json and tokenizer beside the weights" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "out.gguf").exists()


def test_a_torchtitan_export_is_refused_in_one_line(qwen3, tmp_path):
    """A torchtitan step (the tiny Qwen3 under torchtitan 0.3's names) with ``--plan torchtitan
    --hf-config``: the plan writes its own config.json, which GGUF output does not read yet; the
    line says what to do (export the folder, then convert it)."""
    from helpers import cli
    from safetensors.torch import load_file

    from streamck.plan.torchtitan.layout import LAYER, QK_NORM, TOP

    hf = load_file(qwen3 / "model.safetensors")
    rows = [*TOP, *(r.at(i=i) for i in range(2) for r in (*LAYER, *QK_NORM))]
    step = _dcp({r.src: hf[r.out] for r in rows}, tmp_path / "checkpoint" / "step-1")
    args = (
        "rewrite",
        step,
        "-o",
        tmp_path / "out.gguf",
        "-q",
        "--plan",
        "torchtitan",
        "--hf-config",
        qwen3 / "config.json",
    )
    proc = cli(*args, check=2)
    assert "not yet from a built-in --plan's export: write that first (-o DIR)" in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("streamck: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr and not (tmp_path / "out.gguf").exists()
    cli(*args[:3], tmp_path / "hf", *args[4:], check=0)  # the plan itself takes the step: the refusal is GGUF's
