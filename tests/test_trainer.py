"""Hugging Face Trainer + DeepSpeed checkpoints exactly as users have them (tests/trainer_fixtures.py):
every case rewritten to a directory equals DeepSpeed's own fp32 weights and loads in
``from_pretrained`` with the oracle's logits; placeholder and empty weights files, stale
rank files, a missing ``latest``, a rank file given alone, tied heads, per-side ``diff --zero``
and DeepSpeed's BF16_Optimizer, each as the user meets it."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch
import trainer_fixtures
from helpers import cli
from safetensors.torch import load_file

import streamck
from streamck import open_checkpoint

CASES = [c["name"] for c in trainer_fixtures.cases()]


def oracle(case: dict) -> dict[str, torch.Tensor]:
    """DeepSpeed's fp32 weights: zero_to_fp32's (or, for BF16_Optimizer files it refuses, the
    live engine's masters), and the frozen params zero_to_fp32 leaves out of ZeRO-1, from the
    fp32 weights Trainer gathered."""
    sd = torch.load(case["oracle"] or case["live"], weights_only=True)
    if case["stage"] == 1 and case["frozen"]:
        sd.setdefault("model.embed_tokens.weight", load_file(case["checkpoint"] / "model.safetensors")[
            "model.embed_tokens.weight"])  # fmt: skip
    return sd


def logits(model) -> torch.Tensor:
    ids = torch.arange(40).reshape(2, 20) * 37 % 2048
    with torch.no_grad():
        return model(input_ids=ids).logits


def loads_like_the_oracle(out: Path, case: dict) -> None:
    """``out`` loads in from_pretrained with no missing, unexpected or mismatched keys and
    gives the logits of the model built from the oracle's weights."""
    from trainer_fixtures import llama_config
    from transformers import LlamaForCausalLM

    model, info = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ref = LlamaForCausalLM(llama_config(case["tied"])).float()
    want = oracle(case)
    if case["tied"]:
        want.pop("lm_head.weight", None)
    missing, unexpected = ref.load_state_dict(want, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    assert torch.equal(logits(model), logits(ref))


def equals_oracle(got: dict[str, torch.Tensor], case: dict) -> None:
    want = oracle(case)
    for name, t in want.items():
        if name in got:
            assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    assert set(want) - set(got) <= ({"lm_head.weight"} if case["tied"] else set())
    assert set(got) <= set(want) | {"model.embed_tokens.weight"}  # ZeRO-1's frozen one, from the module
    assert all(t.numel() for t in got.values())


def copy(case: dict, tmp_path: Path, step: str = "checkpoint-2") -> Path:
    ck = tmp_path / step
    shutil.copytree(case["dir"] / step, ck)
    return ck


@pytest.mark.parametrize("name", CASES)
def test_trainer_checkpoint_to_a_loadable_model(trainer_cases, tmp_path, name):
    case = trainer_cases[name]
    out = tmp_path / "hf"
    r = cli("rewrite", case["checkpoint"], "--zero", "-o", out, "-q")
    assert r.returncode == 0, r.stderr
    got = load_file(out / "model.safetensors")
    equals_oracle(got, case)
    assert ("lm_head.weight" in got) != case["tied"]
    loads_like_the_oracle(out, case)


def test_partial_placeholder_file_reads_every_tensor_from_the_zero_state(trainer_cases, tmp_path):
    case = trainer_cases["z3_untied_fp32"]
    ck = copy(case, tmp_path)
    # rank 0's save_pretrained under ZeRO-3: small params whole, the embedding and head [0]
    shutil.copy(case["dir"] / "placeholder" / "model.safetensors", ck)
    held = open_checkpoint(ck / "model.safetensors").tensors
    assert not held["lm_head.weight"].numel and held["model.norm.weight"].numel  # the realistic file
    r = cli("rewrite", ck, "-o", tmp_path / "hf", "-q")
    assert r.returncode == 0, r.stderr
    assert "holds 2 size-0 placeholders" in r.stderr and "every tensor from the ZeRO state" in r.stderr
    equals_oracle(load_file(tmp_path / "hf" / "model.safetensors"), case)
    loads_like_the_oracle(tmp_path / "hf", case)


def test_empty_weights_file_reads_the_zero_state(trainer_cases, tmp_path):
    case = trainer_cases["z3_untied_fp32"]
    ck = copy(case, tmp_path)
    shutil.copy(case["dir"] / "empty" / "model.safetensors", ck)
    r = cli("rewrite", ck, "-o", tmp_path / "hf", "-q")
    assert r.returncode == 0, r.stderr
    assert "model.safetensors holds no tensors" in r.stderr
    equals_oracle(load_file(tmp_path / "hf" / "model.safetensors"), case)


def test_size0_tensors_not_in_the_zero_state_are_refused(trainer_cases, tmp_path):
    from safetensors.torch import save_file

    case = trainer_cases["z3_untied_fp32"]
    ck = copy(case, tmp_path)
    save_file({"stray.weight": torch.empty(0)}, ck / "model.safetensors")
    r = cli("rewrite", ck, "-o", tmp_path / "hf")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "'stray.weight'" in r.stderr, r.stderr
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(("name", "pattern"), [
    ("z3_untied_fp32", "*rank_1_*optim_states.pt"),
    ("z3_untied_fp32", "*rank_1_*model_states.pt"),
    ("z2_untied_bf16_frozen", "*rank_1_*optim_states.pt"),
    ("z2_untied_bf16_frozen", "mp_rank_00_model_states.pt"),
    ("z1_tied_fp32_frozen_w3", "mp_rank_00_model_states.pt"),
])  # fmt: skip
def test_stale_rank_file_is_refused_naming_both_files(trainer_cases, tmp_path, name, pattern):
    case = trainer_cases[name]
    ck = copy(case, tmp_path)
    stale = next((case["dir"] / "checkpoint-1" / "global_step1").glob(pattern))
    target = ck / "global_step2" / stale.name
    shutil.copy(stale, target)  # rank 1's file of step 1, same world size
    r = cli("rewrite", ck, "--zero", "-o", tmp_path / "hf")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert stale.name in r.stderr and "different saves" in r.stderr and "1" in r.stderr and "2" in r.stderr
    assert not (tmp_path / "hf").exists()


def test_no_latest_one_step_folder_is_read_with_a_note(trainer_cases, tmp_path):
    case = trainer_cases["z3_untied_fp32"]
    ck = copy(case, tmp_path)
    (ck / "latest").unlink()
    r = cli("rewrite", ck, "-o", tmp_path / "hf", "-q")
    assert r.returncode == 0, r.stderr
    assert "no 'latest' file in checkpoint-2: reading its one ZeRO step, global_step2" in r.stderr
    equals_oracle(load_file(tmp_path / "hf" / "model.safetensors"), case)


def test_no_latest_two_step_folders_names_them(trainer_cases, tmp_path):
    case = trainer_cases["z3_untied_fp32"]
    ck = copy(case, tmp_path)
    (ck / "latest").unlink()
    shutil.copytree(case["dir"] / "checkpoint-1" / "global_step1", ck / "global_step1")
    r = cli("ls", ck)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "no weights here" not in r.stderr
    assert "global_step1, global_step2" in r.stderr and str(ck / "global_step2") in r.stderr
    assert cli("ls", ck / "global_step2").returncode == 0  # what the message says works


def test_a_step_folder_given_itself_takes_the_config_above_it(trainer_cases, tmp_path):
    case = trainer_cases["z3_tied_bf16_w3"]
    for src, out in ((case["checkpoint"], "a"), (case["checkpoint"] / "global_step2", "b")):
        r = cli("rewrite", src, "-o", tmp_path / out, "-q")
        assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == sorted(p.name for p in (tmp_path / "a").iterdir())
    assert cli("diff", tmp_path / "a", tmp_path / "b", "--data").returncode == 0


def test_a_rank_file_given_alone_says_to_pass_its_folder(trainer_cases):
    case = trainer_cases["z3_untied_fp32"]
    for rank in (case["checkpoint"] / "global_step2").glob("*.pt"):
        r = cli("ls", rank)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert "one rank's file of a DeepSpeed ZeRO checkpoint" in r.stderr and "pass its folder" in r.stderr


def test_tied_head_is_written_as_save_pretrained_writes_it(trainer_cases, tmp_path):
    case = trainer_cases["z3_tied_bf16_w3"]
    r = cli("rewrite", case["checkpoint"], "-o", tmp_path / "hf", "-q")
    assert r.returncode == 0, r.stderr
    assert "tied lm_head.weight (= model.embed_tokens.weight) left out" in r.stderr
    assert "lm_head.weight" not in load_file(tmp_path / "hf" / "model.safetensors")
    loads_like_the_oracle(tmp_path / "hf", case)
    r = cli("rewrite", case["checkpoint"], "--keep-tied", "-o", tmp_path / "all.safetensors", "-q")
    got = load_file(tmp_path / "all.safetensors")
    assert r.returncode == 0 and torch.equal(got["lm_head.weight"], got["model.embed_tokens.weight"])
    ck = copy(case, tmp_path)  # a config that does not say tied: every name kept
    config = json.loads((ck / "config.json").read_text())
    (ck / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    assert "lm_head.weight" in open_checkpoint(ck).tensors
    # a multimodal config says it in text_config (Llava, Gemma 3): left out again
    (ck / "config.json").write_text(json.dumps({"text_config": {**config, "tie_word_embeddings": True}}))
    assert "lm_head.weight" not in open_checkpoint(ck).tensors
    # the folder written above holds no tied names: --keep-tied has nothing to keep, and says so
    assert any("--keep-tied does nothing here" in n for n in open_checkpoint(tmp_path / "hf", keep_tied=True).notices)


def test_diff_zero_per_side_compares_gathered_weights_with_the_masters(trainer_cases, tmp_path):
    case = trainer_cases["z3_tied_bf16_gathered"]
    ck = case["checkpoint"]
    r = cli("diff", "--zero-b", ck, ck)  # gathered bf16 weights vs the fp32 masters
    assert r.returncode == 1 and "BF16" in r.stdout and "F32" in r.stdout, r.stdout + r.stderr
    assert "only in" not in r.stdout  # same names: the tied head left out on both sides
    r = cli("rewrite", ck, "--zero", "-o", tmp_path / "hf", "-q")
    assert r.returncode == 0, r.stderr
    assert cli("diff", tmp_path / "hf", ck, "--zero-b", "--data").returncode == 0
    assert streamck.diff(tmp_path / "hf", ck, zero=(False, True), data=True).equal  # the library, per side
    assert not streamck.diff(ck, ck, zero=(False, True)).equal
    r = cli("diff", "--zero", tmp_path / "hf", ck)  # both sides: the plain folder has none
    assert r.returncode == 2 and "no DeepSpeed ZeRO state" in r.stderr


def test_bf16_optimizer_files_are_read(trainer_cases, tmp_path):
    case = trainer_cases["z1_bf16_fp32accum"]
    names = [p.name for p in (case["checkpoint"] / "global_step2").iterdir()]
    assert "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt" in names  # DeepSpeed's BF16_Optimizer
    ck = open_checkpoint(case["checkpoint"], zero=True)
    live = torch.load(case["live"], weights_only=True)
    assert set(live) <= set(ck.tensors)
    for name, t in live.items():
        got = torch.frombuffer(bytearray(ck.read(name)), dtype=torch.float32).reshape(t.shape)
        assert torch.equal(got, t), name


def test_notices_say_what_zero_to_fp32_does(trainer_cases):
    z1 = open_checkpoint(trainer_cases["z1_tied_fp32_frozen_w3"]["checkpoint"], zero=True).notices
    assert any("frozen params model.embed_tokens.weight" in n and "zero_to_fp32 leaves them out" in n for n in z1)
    z2 = open_checkpoint(trainer_cases["z2_untied_bf16_frozen"]["checkpoint"], zero=True).notices
    assert not any("zero_to_fp32 leaves" in n for n in z2)  # ZeRO-2 saves its frozen params
