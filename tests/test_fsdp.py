"""Hugging Face Trainer + FSDP (accelerate) checkpoints exactly as users have them
(tests/fsdp_fixtures.py): ``checkpoint-N/`` with SHARDED_STATE_DICT's ``pytorch_model_fsdp_0/``
read as the model save_pretrained writes, equal to accelerate's own ``merge_fsdp_weights``
and loading in ``from_pretrained`` with the trained model's logits; FULL_STATE_DICT's
``pytorch_model_fsdp.bin`` the same way; FSDP1's LOCAL_STATE_DICT rank files refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import fsdp_fixtures
import pytest
import torch
from helpers import cli, fixture_root
from safetensors.torch import load_file

from streamck import open_checkpoint

SHARDED = [c["name"] for c in fsdp_fixtures.cases() if c["state_dict_type"] == "SHARDED_STATE_DICT"]


@pytest.fixture(scope="session")
def fsdp_cases(request, tmp_path_factory) -> dict[str, dict]:
    """Trainer + FSDP runs under torchrun (tests/fsdp_fixtures.py), made once and kept on
    the machine (tests/fixture_cache.py)."""
    root = fixture_root(tmp_path_factory, "fsdp", "tests/fsdp_fixtures.py", "tests/trainer_fixtures.py")
    return fsdp_fixtures.make_fsdp_checkpoints(root)


def merged(case: dict) -> dict[str, torch.Tensor]:
    """accelerate's own merge_fsdp_weights of checkpoint-2 (every name, tied heads too)."""
    return load_file(case["merged"] / "model.safetensors")


def logits(model) -> torch.Tensor:
    ids = torch.arange(40).reshape(2, 20) * 37 % fsdp_fixtures.VOCAB
    with torch.no_grad():
        return model(input_ids=ids).logits


def loads_like_the_trained_model(out: Path, case: dict) -> None:
    """``out`` loads in from_pretrained with no missing, unexpected or mismatched keys and
    gives the logits of the trained model (its full state dict taken live)."""
    from transformers import LlamaForCausalLM

    model, info = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    trained = LlamaForCausalLM(fsdp_fixtures.llama_config(case["tied"])).float()
    trained.load_state_dict(torch.load(case["live"], weights_only=True))
    assert torch.equal(logits(model), logits(trained))


def equals(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], left_out: set[str] = frozenset()) -> None:
    assert set(got) == set(want) - left_out, set(got) ^ set(want)
    for name, t in got.items():
        assert t.dtype == want[name].dtype and torch.equal(t, want[name]), name


def with_config(case: dict, tmp_path: Path, src: str = "checkpoint-2") -> Path:
    """checkpoint-2 (or ``src``) with the config the run started from beside it, as a user
    puts it there (Trainer saves none with SHARDED_STATE_DICT)."""
    ck = tmp_path / "checkpoint-2"
    shutil.copytree(case["dir"] / src, ck)
    shutil.copy(case["dir"] / "base" / "config.json", ck)
    return ck


def test_oracle_is_the_trained_model(fsdp_cases):
    for name in SHARDED:
        equals(merged(fsdp_cases[name]), torch.load(fsdp_cases[name]["live"], weights_only=True))


@pytest.mark.parametrize("name", SHARDED)
def test_sharded_checkpoint_to_a_loadable_model(fsdp_cases, tmp_path, name):
    case = fsdp_cases[name]
    ck = with_config(case, tmp_path)
    r = cli("rewrite", ck, "-o", tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    assert "left out beside it: optimizer_0 (optimizer state)" in r.stderr and "no config.json" not in r.stderr
    got = load_file(tmp_path / "hf" / "model.safetensors")
    equals(got, merged(case), {"lm_head.weight"} if case["tied"] else set())
    assert (tmp_path / "hf" / "config.json").is_file()
    if case["tied"]:
        assert "tied lm_head.weight (= model.embed_tokens.weight) left out" in r.stderr
    loads_like_the_trained_model(tmp_path / "hf", case)


def test_as_trainer_left_it_every_name_kept_and_the_missing_config_said(fsdp_cases, tmp_path):
    case = fsdp_cases["fsdp2_sharded_tied"]
    r = cli("rewrite", case["checkpoint"], "-o", tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    assert "no config.json in checkpoint-2" in r.stderr and "tied" not in r.stderr
    equals(load_file(tmp_path / "hf" / "model.safetensors"), merged(case))  # what merge-weights writes


@pytest.mark.parametrize("step", ["2", "latest"])
def test_run_root_with_step(fsdp_cases, tmp_path, step):
    case = fsdp_cases["fsdp2_sharded_untied"]
    r = cli("rewrite", case["dir"], "--step", step, "-o", tmp_path / "hf", "-q")
    assert r.returncode == 0, r.stderr
    equals(load_file(tmp_path / "hf" / "model.safetensors"), merged(case))
    assert cli("ls", case["dir"], "--step", "1").returncode == 0


def test_the_model_folder_given_itself_reads_the_same(fsdp_cases, tmp_path):
    case = fsdp_cases["fsdp1_sharded_tied"]
    ck = with_config(case, tmp_path)
    whole, sub = open_checkpoint(ck), open_checkpoint(ck / "pytorch_model_fsdp_0")
    assert list(whole.tensors) == list(sub.tensors) and sub.side_root == ck
    assert not any(n.startswith("model.model.") for n in sub.tensors)


def test_keep_tied_writes_every_name(fsdp_cases, tmp_path):
    case = fsdp_cases["fsdp2_sharded_tied"]
    ck = with_config(case, tmp_path)
    r = cli("rewrite", ck, "--keep-tied", "-o", tmp_path / "all.safetensors", "-q")
    assert r.returncode == 0, r.stderr
    equals(load_file(tmp_path / "all.safetensors"), merged(case))


def test_untied_head_is_kept_with_a_config(fsdp_cases, tmp_path):
    ck = with_config(fsdp_cases["fsdp2_sharded_untied"], tmp_path)
    assert "lm_head.weight" in open_checkpoint(ck).tensors


def test_full_state_dict_bin_reads_as_the_model(fsdp_cases, tmp_path):
    """FULL_STATE_DICT: accelerate's own save_fsdp_model writes pytorch_model_fsdp.bin."""
    case = fsdp_cases["fsdp2_sharded_tied"]
    ck = with_config(case, tmp_path, "full")
    r = cli("rewrite", ck, "-o", tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    assert "tied lm_head.weight (= model.embed_tokens.weight) left out" in r.stderr
    equals(load_file(tmp_path / "hf" / "model.safetensors"), merged(case), {"lm_head.weight"})
    loads_like_the_trained_model(tmp_path / "hf", case)


def test_local_state_dict_rank_files_are_refused_in_one_line(fsdp_cases, tmp_path):
    ck = fsdp_cases["fsdp1_local_untied"]["checkpoint"]
    for src in (ck, ck / "pytorch_model_fsdp_rank1.bin"):
        r = cli("rewrite", src, "-o", tmp_path / "hf")
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
        assert "LOCAL_STATE_DICT" in r.stderr and "pytorch_model_fsdp_rank" in r.stderr
        assert not (tmp_path / "hf").exists()


def test_per_rank_sharded_files_are_refused_in_one_line(fsdp_cases, tmp_path):
    """save_fsdp_model(use_dcp=False): one torch.save of each rank's DTensor shards."""
    d = fsdp_cases["fsdp2_sharded_untied"]["dir"] / "per_rank"
    assert sorted(p.name for p in d.iterdir()) == [f"pytorch_model_fsdp_0_rank{r}.bin" for r in (0, 1)]
    for src in (d, d / "pytorch_model_fsdp_0_rank0.bin"):
        r = cli("rewrite", src, "-o", tmp_path / "hf")
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "use_dcp=False" in r.stderr, r.stderr
        assert not (tmp_path / "hf").exists()


def test_diff_against_accelerates_merge_finds_them_equal(fsdp_cases):
    case = fsdp_cases["fsdp2_sharded_untied"]
    r = cli("diff", case["checkpoint"], case["merged"], "--data")
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_model_folder_without_the_model_item_is_refused(fsdp_cases, tmp_path):
    """accelerate's optimizer folder (DCP of {"optimizer": ...}) where the model's should be."""
    case = fsdp_cases["fsdp2_sharded_untied"]
    ck = tmp_path / "checkpoint-2"
    ck.mkdir()
    shutil.copytree(case["checkpoint"] / "optimizer_0", ck / "pytorch_model_fsdp_0")
    r = cli("rewrite", ck, "-o", tmp_path / "hf")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "'model'" in r.stderr, r.stderr
    assert not (tmp_path / "hf").exists()


def test_key_is_the_model_item_or_refused(fsdp_cases, tmp_path):
    ck = fsdp_cases["fsdp2_sharded_untied"]["checkpoint"]
    assert list(open_checkpoint(ck, key="model").tensors) == list(open_checkpoint(ck).tensors)
    r = cli("ls", ck, "--key", "optimizer")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "'model'" in r.stderr, r.stderr
