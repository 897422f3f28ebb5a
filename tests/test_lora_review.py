"""--merge-lora: output dtypes of saved copies, adapter_config.json values, the merge's blocks
under --verify, a LoRA and a saved copy of one tensor, and the flags that need --merge-lora.
The adapters are PEFT's own; bad configs are PEFT's adapter_config.json hand-edited."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import cli
from lora_fixtures import make_adapter, make_base, peft_merge
from safetensors import safe_open
from test_lora import assert_same, load_dir
from test_lora_refusals import refused

import streamck.transforms.lora
from streamck import write_plan
from streamck.api import build_plan
from streamck.errors import UsageError

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("lora-review")


@pytest.fixture(scope="module")
def base(root):
    return make_base(root / "base")


@pytest.fixture(scope="module")
def f32_copies(root, base):
    """A bf16 base; an adapter trained on it in fp32, so its saved copy of model.norm is F32."""
    adapter = make_adapter(
        base, root / "f32-copies", target_modules=["q_proj"], modules_to_save=["norm"], prepare=lambda m: m.float()
    )
    return adapter, peft_merge(base, adapter, root / "f32-copies-peft")


@pytest.fixture(scope="module")
def plain(root, base):
    return make_adapter(base, root / "plain")


def test_saved_copy_takes_the_base_dtype(base, f32_copies, tmp_path):
    adapter, want = f32_copies
    with safe_open(adapter / "adapter_model.safetensors", "pt") as f:  # the case needs an F32 copy
        assert f.get_slice("base_model.model.model.norm.weight").get_dtype() == "F32"
    write_plan(build_plan(base, merge_lora=adapter), tmp_path / "out")
    assert_same(tmp_path / "out", want)
    write_plan(build_plan(base, merge_lora=adapter, dtype="bf16"), tmp_path / "same")
    assert_same(tmp_path / "same", want)
    peft = load_dir(want)
    for engine in ("torch", "numpy"):  # PEFT's bf16 output, then --dtype: rounded twice
        write_plan(
            build_plan(base, merge_lora=adapter, dtype="f16", merge_engine=engine), tmp_path / engine, verify=True
        )
        got = load_dir(tmp_path / engine)
        assert {t.dtype for t in got.values()} == {torch.float16}
        assert torch.equal(got["model.norm.weight"], peft["model.norm.weight"].to(torch.float16)), engine
    dry = ("rewrite", base, "-o", tmp_path / "dry", "--merge-lora", adapter, "--dtype", "f16", "--dry-run")
    listing = cli(*dry, check=0).stdout
    row = next(line.split() for line in listing.splitlines() if " model.norm.weight " in line)
    assert row[:3] == ["base_model.model.model.norm.weight", "model.norm.weight", "F32->F16"], row


def test_untied_head_takes_the_embedding_output_dtype(root, tmp_path):
    tied = make_base(root / "tied", tied=True)
    adapter = make_adapter(
        tied, root / "tied-head", target_modules=["q_proj"], modules_to_save=["lm_head"], prepare=lambda m: m.float()
    )
    want = peft_merge(tied, adapter, root / "tied-head-peft")
    write_plan(build_plan(tied, merge_lora=adapter), tmp_path / "out")
    assert_same(tmp_path / "out", want)
    plan = build_plan(tied, merge_lora=adapter, casts={"model.embed_tokens.weight": "f16"})
    assert {t.name: t.dtype for t in plan.tensors}["lm_head.weight"] == "F16"


def edited(adapter, tmp_path, **changes):
    out = tmp_path / "edited"
    shutil.copytree(adapter, out)
    path = out / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return out


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"rank_pattern": {"up_proj(": 4}}, ["rank_pattern", "'up_proj('", "regular expression"]),
        ({"alpha_pattern": {"[v": 4}}, ["alpha_pattern", "regular expression"]),
        ({"alpha_pattern": {"v_proj": "4"}}, ["alpha_pattern", "not a number"]),
        ({"rank_pattern": {"v_proj": 0}}, ["rank_pattern", "positive integer"]),
        ({"lora_alpha": "16"}, ["lora_alpha", "'16'", "not a number"]),
        ({"r": 0}, ["r is 0", "positive integer"]),
        ({"r": 8.5}, ["r is 8.5"]),
        ({"r": True}, ["r is True"]),
    ],
)
def test_bad_config_values(base, plain, tmp_path, changes, words):
    adapter = edited(plain, tmp_path / "a", **changes)
    (tmp_path / "run").mkdir()
    refused(base, adapter, tmp_path / "run", "adapter_config.json", *words)
    proc = cli("rewrite", base, "-o", tmp_path / "run" / "out", "--merge-lora", adapter, "--dry-run", check=2)
    assert len(proc.stderr.strip().splitlines()) == 1 and "adapter_config.json" in proc.stderr


def test_lora_bias_flag_and_tensors_disagree(root, tmp_path):
    biased = make_base(root / "biased", attention_bias=True)
    adapter = make_adapter(biased, root / "lora-bias", target_modules=["q_proj"], lora_bias=True)
    (tmp_path / "run").mkdir()
    refused(biased, edited(adapter, tmp_path, lora_bias=False), tmp_path / "run", "lora_B has a bias", "lora_bias")


def test_verify_computes_the_written_blocks(base, plain, tmp_path, monkeypatch):
    """The write and --verify cut each merge into the same blocks, whatever the writer's chunk."""
    calls = []
    real = streamck.transforms.lora.row_blocks

    def spy(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(streamck.transforms.lora, "row_blocks", spy)  # both engines' blocks
    for engine in ("torch", "numpy"):
        plan = build_plan(base, merge_lora=plain, merge_engine=engine)
        calls.clear()
        write_plan(plan, tmp_path / f"{engine}-w", chunk=4096)
        written = sorted(calls)
        calls.clear()
        write_plan(plan, tmp_path / f"{engine}-v", chunk=4096, verify=True)
        assert written and sorted(calls) == sorted(written * 2), engine


def test_lora_and_saved_copy_of_one_tensor(root, tmp_path):
    """A tied lm_head's LoRA merges into the embedding; a saved copy of it as well: refused."""
    tied = make_base(root / "tied2", tied=True)
    adapter = make_adapter(tied, root / "twice", target_modules=["lm_head"], modules_to_save=["embed_tokens"])
    (tmp_path / "run").mkdir()
    refused(tied, adapter, tmp_path / "run", "changes model.embed_tokens.weight twice", "adapter_model")


@pytest.mark.parametrize(
    ("kw", "flag"),
    [
        ({"safe_merge": True}, "--safe-merge"),
        ({"merge_engine": "numpy"}, "--merge-engine"),
        ({"merge_lora_any_base": True}, "--merge-lora-any-base"),
    ],
)
def test_lora_flags_need_merge_lora(base, tmp_path, kw, flag):
    with pytest.raises(UsageError, match=f"^{next(iter(kw))} applies to merge_lora only$"):  # the library's names
        build_plan(base, **kw)
    args = [flag] + (["numpy"] if flag == "--merge-engine" else [])
    proc = cli("rewrite", base, "-o", tmp_path / "out", *args, check=2)
    assert len(proc.stderr.strip().splitlines()) == 1 and flag in proc.stderr
    assert not (tmp_path / "out").exists()


def test_any_base_keyword(root, base, tmp_path):
    adapter = make_adapter(base, root / "other-name")
    config = adapter / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "base_model_name_or_path": "org/another"}))
    plan = build_plan(base, merge_lora=adapter, merge_lora_any_base=True)
    assert any(t.transform is not None for t in plan.tensors)
