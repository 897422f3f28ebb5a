"""Every family in streamck.plan.moe.FAMILIES against transformers 5's own save_pretrained and
load: a model's runtime state dict (fused experts, what a trainer saves) rewritten by streamck
equals save_pretrained's file bit for bit and loads with no missing or unexpected keys and the
same logits; --fuse-experts of save_pretrained's file equals what from_pretrained builds."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import cli
from moe_models import logits, tiny_model
from moe_models import runtime_save as _runtime_save
from safetensors.torch import load_file, save_file

import streamck
from streamck.plan.moe.families import FAMILIES, REFUSED

pytestmark = pytest.mark.filterwarnings("ignore")


def _fused_moe_model_types() -> list[str]:
    """Every model_type transformers ships that runs as a language model (a causal LM or an
    image-text-to-text model) with experts fused at run time: its modeling file decorates an
    experts class with @use_experts_implementation or holds a fused gate_up_proj parameter."""
    import re
    from pathlib import Path

    import transformers
    from transformers.models.auto import configuration_auto, modeling_auto

    fused = re.compile(r"@use_experts_implementation|self\.gate_up_proj = nn\.Parameter")
    root = Path(transformers.__file__).parent / "models"
    modules = {p.parent.name for p in root.glob("*/modeling_*.py") if fused.search(p.read_text())}
    lm = {**modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, **modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES}
    names = configuration_auto.CONFIG_MAPPING_NAMES
    return sorted(t for t in names if t in lm and configuration_auto.model_type_to_module_name(t) in modules)


def test_every_fused_moe_family_is_known():
    """A family is in the table (and so checked below) or refused with its reason; none unheard of."""
    types = _fused_moe_model_types()
    assert len(types) > 50  # the scan itself still finds transformers' MoE models
    assert [t for t in types if t not in FAMILIES and t not in REFUSED] == []
    assert set(FAMILIES) | set(REFUSED) <= set(types)


def _equal(got: dict, want: dict) -> None:
    assert set(got) == set(want), sorted(set(got) ^ set(want))[:10]
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_runtime_save_to_save_pretrained(model_type, moe_saves, tmp_path):
    model, src, hf = moe_saves.model(model_type), moe_saves.runtime(model_type), moe_saves.hf(model_type)
    streamck.rewrite(src, tmp_path / "out")
    _equal(load_file(tmp_path / "out" / "model.safetensors"), load_file(hf / "model.safetensors"))
    loaded, info = type(model).from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert torch.equal(logits(loaded.float().eval()), logits(model))


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_fuse_experts_is_transformers_own_load(model_type, moe_saves, tmp_path):
    hf = moe_saves.hf(model_type)
    loaded = type(moe_saves.model(model_type)).from_pretrained(hf, dtype=torch.float32)
    streamck.rewrite(hf, tmp_path / "fused", experts="fuse")
    _equal(load_file(tmp_path / "fused" / "model.safetensors"), dict(loaded.state_dict()))


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_ls_says_the_layout(model_type, moe_saves):
    """ls names the experts of a trainer's runtime save and of save_pretrained's files, whatever
    the family names them (Granite-MoE's input_linear, Aria's experts.fc1 are fused too)."""
    kind = "per-expert" if FAMILIES[model_type].per_expert else "fused"
    assert "MoE: 4 experts, fused (" in cli("ls", str(moe_saves.runtime(model_type)), check=0).stdout
    assert f"MoE: 4 experts, {kind} (" in cli("ls", str(moe_saves.hf(model_type)), check=0).stdout


def test_rewrite_says_fused_families_stay_fused(tmp_path):
    src = _runtime_save(tiny_model("granitemoe"), tmp_path / "runtime")
    dry = cli("rewrite", str(src), "-o", str(tmp_path / "dry"), "--dry-run", check=0).stdout
    assert "MoE: 4 experts, fused (2 blocks): granitemoe experts written fused, as save_pretrained writes them" in dry


def test_cli_keep_fused_and_ls(tmp_path):
    model = tiny_model("qwen3_moe")
    src = _runtime_save(model, tmp_path / "runtime")
    ls = cli("ls", str(src), check=0).stdout
    assert "MoE: 4 experts, fused (2 blocks)" in ls
    cli("rewrite", str(src), "-o", str(tmp_path / "kept"), "--keep-fused", check=0)
    _equal(load_file(tmp_path / "kept" / "model.safetensors"), load_file(src / "model.safetensors"))
    done = cli("rewrite", str(src), "-o", str(tmp_path / "out"), check=0)
    assert "MoE: 4 experts, per-expert (2 blocks)" in cli("ls", str(tmp_path / "out"), check=0).stdout, done.stderr
    dry = cli("rewrite", str(src), "-o", str(tmp_path / "dry"), "--dry-run", check=0).stdout
    assert "model.layers.0.mlp.experts.gate_up_proj[3][8:16]" in dry and "qwen3_moe experts written per expert" in dry


def test_no_config_keeps_fused_with_a_note(tmp_path):
    src = _runtime_save(tiny_model("mixtral"), tmp_path / "runtime")
    (src / "config.json").unlink()
    done = cli("rewrite", str(src), "-o", str(tmp_path / "out"), check=0)
    assert "no config.json" in done.stderr and "--keep-fused" in done.stderr
    _equal(load_file(tmp_path / "out" / "model.safetensors"), load_file(src / "model.safetensors"))
    quiet = cli("rewrite", str(src), "-o", str(tmp_path / "kept"), "--keep-fused", check=0)
    assert "config.json" not in quiet.stderr
    done = cli("rewrite", str(src), "-o", str(tmp_path / "fused"), "--fuse-experts", check=2)
    assert "--fuse-experts needs the model's config.json" in done.stderr and not (tmp_path / "fused").exists()


def _config(src, **changes):
    path = src / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_experts": 8}, "4 experts, but config.json says 8"),
        ({"model_type": "unheard_of_moe"}, "model_type 'unheard_of_moe' has experts but no known layout"),
        (
            {"model_type": "nemotron_h"},
            "'nemotron_h': experts not rewritten, save_pretrained renames the whole model",
        ),
    ],
)
def test_refused_config(change, message, tmp_path):
    src = _runtime_save(tiny_model("qwen3_moe"), tmp_path / "runtime")
    config = json.loads((src / "config.json").read_text())
    config.pop("num_local_experts", None)
    config.update(change)
    (src / "config.json").write_text(json.dumps(config))
    done = cli("rewrite", str(src), "-o", str(tmp_path / "out"), check=2)
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "out").exists()


def test_refused_router_rows(tmp_path):
    model = tiny_model("qwen3_moe")
    src = tmp_path / "runtime"
    src.mkdir()
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    sd["model.layers.1.mlp.gate.weight"] = sd["model.layers.1.mlp.gate.weight"][:3].clone()
    save_file(sd, src / "model.safetensors")
    model.config.save_pretrained(src)
    done = cli("rewrite", str(src), "-o", str(tmp_path / "out"), check=2)
    assert "router model.layers.1.mlp.gate.weight has shape [3, 16], not 4 rows" in done.stderr
    assert not (tmp_path / "out").exists()


def test_refused_missing_expert(tmp_path):
    """A per-expert checkpoint with one expert's files gone (an EP rank's) is refused, not written short."""
    model = tiny_model("mixtral")
    model.save_pretrained(tmp_path / "hf")
    sd = load_file(tmp_path / "hf" / "model.safetensors")
    gone = {k for k in sd if ".experts.3." in k and "layers.0." in k}
    save_file({k: v for k, v in sd.items() if k not in gone}, tmp_path / "hf" / "model.safetensors")
    for flag in ((), ("--fuse-experts",)):
        done = cli("rewrite", str(tmp_path / "hf"), "-o", str(tmp_path / "out"), *flag, check=2)
        assert "model.layers.0.block_sparse_moe: experts 3 have no w1.weight (4 experts)" in done.stderr
        assert not (tmp_path / "out").exists()


def test_longcat_hub_layout(tmp_path):
    """LongCat's files as published hold no gate/up for its zero (identity) experts, which
    transformers' fused gate_up_proj has rows for: read and kept as they are, and --fuse-experts,
    which cannot make those rows, refuses in one line."""
    tiny_model("longcat_flash").save_pretrained(tmp_path / "hf")
    sd = load_file(tmp_path / "hf" / "model.safetensors")
    hub = {k: v for k, v in sd.items() if ".experts.4." not in k and ".experts.5." not in k}
    assert len(hub) < len(sd)
    save_file(hub, tmp_path / "hf" / "model.safetensors")
    cli("rewrite", str(tmp_path / "hf"), "-o", str(tmp_path / "out"), check=0)
    _equal(load_file(tmp_path / "out" / "model.safetensors"), hub)
    done = cli("rewrite", str(tmp_path / "hf"), "-o", str(tmp_path / "fused"), "--fuse-experts", check=2)
    assert "experts 4..5 (past the 4 routed ones) have no gate_proj/up_proj.weight" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "fused").exists()
