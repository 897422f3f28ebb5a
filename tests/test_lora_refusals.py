"""What --merge-lora refuses: one line naming the file and the reason, exit status 2, nothing
at the output path. The adapters are PEFT's own (one hand-built file for hostile input)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import cli
from lora_fixtures import make_adapter, make_base, peft_merge
from safetensors.torch import save_file
from test_lora import assert_same

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-refusals")
    return {"base": make_base(root / "base"), "tied": make_base(root / "tied", tied=True), "root": root}


def refused(base, adapter, tmp_path, *words, extra=()) -> str:
    out = tmp_path / "out"
    proc = cli("rewrite", base, "-o", out, "--merge-lora", adapter, *extra, check=2)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("streamck: error: "), proc.stderr
    assert all(w in lines[0] for w in words), lines[0]
    assert not out.exists() and list(tmp_path.iterdir()) == []
    return lines[0]


@pytest.mark.parametrize(
    ("name", "options", "words"),
    [
        ("replication", {"layer_replication": [[0, 2], [1, 2]]}, ["layer_replication"]),
        ("experts", {"target_modules": [], "target_parameters": ["mlp.up_proj.weight"]}, ["target_parameters"]),
        ("dora_embedding", {"target_modules": ["embed_tokens"], "use_dora": True}, ["DoRA on an embedding"]),
        (
            "resized",
            {
                "target_modules": ["q_proj"],
                "modules_to_save": ["embed_tokens"],
                "prepare": lambda m: m.resize_token_embeddings(264),
            },
            ["resized vocabulary", "[264, 64]"],
        ),
    ],
)
def test_refused_settings(bases, tmp_path_factory, tmp_path, name, options, words):
    adapter = make_adapter(bases["base"], tmp_path_factory.mktemp(name), **options)
    refused(bases["base"], adapter, tmp_path, *words, "adapter_")


def test_ensure_weight_tying_on_a_tied_base(bases, tmp_path_factory, tmp_path):
    """PEFT would add the delta twice to the one shared tensor: refused, not copied."""
    options = {"target_modules": ["embed_tokens", "q_proj"], "ensure_weight_tying": True}
    adapter = make_adapter(bases["tied"], tmp_path_factory.mktemp("ewt"), **options)
    refused(bases["tied"], adapter, tmp_path, "ensure_weight_tying", "twice")


def test_other_peft_types(bases, tmp_path_factory, tmp_path):
    from lora_fixtures import load_base
    from peft import LoHaConfig, get_peft_model

    adapter = tmp_path_factory.mktemp("loha")
    get_peft_model(load_base(bases["base"]), LoHaConfig(target_modules=["q_proj"])).save_pretrained(adapter)
    refused(bases["base"], adapter, tmp_path, "LOHA adapter", "adapter_config.json")


def test_another_base_by_name(bases, tmp_path_factory, tmp_path):
    """Trained on a base of another name: refused; --merge-lora-any-base merges it as PEFT does."""
    other = tmp_path_factory.mktemp("named") / "other-model"
    shutil.copytree(bases["base"], other)
    adapter = make_adapter(other, tmp_path_factory.mktemp("other-adapter"))
    refused(bases["base"], adapter, tmp_path, "other-model", "--merge-lora-any-base")
    want = peft_merge(bases["base"], adapter, tmp_path_factory.mktemp("other-peft"))
    cli("rewrite", bases["base"], "-o", tmp_path / "ok", "--merge-lora", adapter, "--merge-lora-any-base", check=0)
    assert_same(tmp_path / "ok", want)


def test_another_base_by_shape(bases, tmp_path_factory, tmp_path):
    """Same folder name, other shapes: refused before anything is written."""
    wider = make_base(tmp_path_factory.mktemp("wider") / "base", intermediate_size=96)
    adapter = make_adapter(wider, tmp_path_factory.mktemp("wider-adapter"))
    refused(bases["base"], adapter, tmp_path, "mlp", "another base")


def test_unknown_adapter_tensor(bases, tmp_path_factory, tmp_path):
    """Hostile input: a tensor that is no LoRA part, copy or base module."""
    adapter = tmp_path_factory.mktemp("odd")
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16}))
    save_file(
        {"base_model.model.model.layers.0.self_attn.q_proj.lora_Z.weight": torch.zeros(8, 64)},
        adapter / "adapter_model.safetensors",
    )
    refused(bases["base"], adapter, tmp_path, "lora_Z", "adapter_model.safetensors")


def test_not_an_adapter(bases, tmp_path):
    refused(bases["base"], bases["tied"], tmp_path, "no adapter_config.json")


def test_dora_flag_and_tensors_disagree(bases, tmp_path_factory, tmp_path):
    """Damaged input: a DoRA adapter whose config says use_dora false would merge as plain LoRA."""
    adapter = make_adapter(
        bases["base"], tmp_path_factory.mktemp("dora-flag"), target_modules=["q_proj"], use_dora=True
    )
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "use_dora": False}))
    refused(bases["base"], adapter, tmp_path, "lora_magnitude_vector", "use_dora")


def test_not_with_a_built_in_plan(bases, tmp_path):
    proc = cli(
        "rewrite", bases["base"], "-o", tmp_path / "out", "--plan", "eagle4", "--merge-lora", bases["tied"], check=2
    )
    assert "--merge-lora merges into a base checkpoint, not into --plan eagle4" in proc.stderr
    assert not (tmp_path / "out").exists()
