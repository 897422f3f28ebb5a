"""GGUF output from a training checkpoint (#50 item 1): a PyTorch DCP save (what FSDP2's
``dcp.save`` writes) with the model's config and tokenizer beside it gives the reference's file
of the same weights. A built-in plan's export (torchtitan, with ``hf_config``): tests/test_plan_to_gguf.py."""

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
