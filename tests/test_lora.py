"""--merge-lora against PEFT itself: PeftModel.from_pretrained, merge_and_unload and
save_pretrained on the same base and adapter (tests/lora_fixtures.py) must give the same
tensors bit for bit, the same names and the same tie_word_embeddings."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import cli
from lora_fixtures import CASES, build_case, config_of
from safetensors.torch import load_file

from streamck import write_plan
from streamck.api import build_plan

pytest.importorskip("peft")


@pytest.fixture(scope="session")
def lora_cases(tmp_path_factory):
    root, cache = tmp_path_factory.mktemp("lora"), {}
    return lambda name: build_case(root, name, cache)


def load_dir(path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def assert_same(got_dir, want_dir) -> None:
    got, want = load_dir(got_dir), load_dir(want_dir)
    assert sorted(got) == sorted(want)
    differ = [
        k
        for k in want
        if got[k].dtype != want[k].dtype
        or not torch.equal(got[k].view(-1).view(torch.uint8), want[k].view(-1).view(torch.uint8))
    ]
    assert differ == []
    assert config_of(got_dir).get("tie_word_embeddings") == config_of(want_dir).get("tie_word_embeddings")


@pytest.mark.parametrize("name", sorted(CASES))
def test_merge_equals_peft(lora_cases, name, tmp_path):
    """Small blocks (16 rows, 4 KiB of fp32) so every tensor is merged in several blocks."""
    case = lora_cases(name)
    plan = build_plan(case["base"], merge_lora=case["adapter"], safe_merge=case.get("safe_merge", False))
    write_plan(plan, tmp_path / "out", chunk=4096)
    assert_same(tmp_path / "out", case["oracle"])


def test_the_merge_changes_what_it_merges(lora_cases, tmp_path):
    """The oracle is not the base: a merge that wrote the base unchanged would fail above."""
    case = lora_cases("plain")
    base, merged = load_dir(case["base"]), load_dir(case["oracle"])
    changed = sorted(k for k in base if not torch.equal(base[k], merged[k]))
    assert len(changed) == 14 and all("proj" in k for k in changed)


def test_cli_merge_and_verify(lora_cases, tmp_path):
    case = lora_cases("dora")
    proc = cli("rewrite", case["base"], "-o", tmp_path / "out", "--merge-lora", case["adapter"], "--verify", check=0)
    assert proc.stdout == ""
    assert_same(tmp_path / "out", case["oracle"])


def test_dry_run_says_what_merges(lora_cases):
    case = lora_cases("rslora_patterns")
    proc = cli("rewrite", case["base"], "-o", "x", "--merge-lora", case["adapter"], "--dry-run", check=0)
    assert "merging rsLoRA adapter" in proc.stdout and "14 modules" in proc.stdout
    assert proc.stdout.count(" +LoRA") == 14


def test_merge_then_cast(lora_cases, tmp_path):
    """--dtype after the merge: PEFT's bf16 result, cast (here to fp32: exact)."""
    case = lora_cases("plain")
    cli("rewrite", case["base"], "-o", tmp_path / "out", "--merge-lora", case["adapter"], "--dtype", "fp32", check=0)
    got, want = load_dir(tmp_path / "out"), load_dir(case["oracle"])
    assert all(got[k].dtype == torch.float32 and torch.equal(got[k], want[k].float()) for k in want)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "float32"


def test_torch_archive_and_jobs(lora_cases, tmp_path):
    """The merge through the torch.save writer (every byte through its CRC) and through
    several jobs writing shards at once: the same tensors."""
    case = lora_cases("embedding_and_saved_head")
    cli("rewrite", case["base"], "-o", tmp_path / "m.bin", "--merge-lora", case["adapter"], "--verify", check=0)
    got, want = torch.load(tmp_path / "m.bin", weights_only=True), load_dir(case["oracle"])
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    args = ("--max-shard-size", "20KB", "--jobs", "2")
    cli("rewrite", case["base"], "-o", tmp_path / "sharded", "--merge-lora", case["adapter"], *args, check=0)
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    assert_same(tmp_path / "sharded", case["oracle"])


def test_keys_with_the_adapter_name(lora_cases, tmp_path):
    """The in-memory state dict's names (``lora_A.default.weight``, ``lora_magnitude_vector.default.weight``),
    as a tool that saves a PeftModel's state_dict() writes them: the same merge."""
    import re
    import shutil

    from safetensors.torch import save_file

    case = lora_cases("dora")
    adapter = tmp_path / "named"
    shutil.copytree(case["adapter"], adapter)
    tensors = load_file(adapter / "adapter_model.safetensors")
    pattern = r"\.(lora_A|lora_B|lora_magnitude_vector)(\.weight)?$"
    renamed = {re.sub(pattern, r".\1.default.weight", k): v for k, v in tensors.items()}
    assert sum(".default." in k for k in renamed) == len(tensors)
    save_file(renamed, adapter / "adapter_model.safetensors", metadata={"format": "pt"})
    write_plan(build_plan(case["base"], merge_lora=adapter), tmp_path / "out", chunk=4096)
    assert_same(tmp_path / "out", case["oracle"])
