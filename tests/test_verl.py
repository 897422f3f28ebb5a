"""verl 0.9.1 FSDP actor checkpoints (tests/verl_fixtures.py: verl's own engine and checkpoint
manager under torchrun on CPU), checked against verl's own merger, torch's gather of the trained
model and transformers' logits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import verl_fixtures
from helpers import cli, fixture_root
from safetensors.torch import load_file

PLAIN = [c["name"] for c in verl_fixtures.cases() if not c["lora"]]


@pytest.fixture(scope="session")
def verl_cases(request, tmp_path_factory) -> dict[str, dict]:
    """verl runs under torchrun, made once and kept on the machine (tests/fixture_cache.py)."""
    root = fixture_root(tmp_path_factory, "verl", *verl_fixtures.CODE)
    return verl_fixtures.make_verl_checkpoints(root)


def rewrite(src, out: Path, *args: str) -> dict[str, torch.Tensor]:
    cli("rewrite", src, "-o", out, *args, check=0)
    return load_file(out / "model.safetensors")


def assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want), set(got) ^ set(want)
    for name, t in got.items():
        w = want[name]
        assert t.dtype == w.dtype and t.shape == w.shape, name
        assert torch.equal(t.view(torch.uint8), w.view(torch.uint8)), name


@pytest.mark.parametrize("name", PLAIN)
def test_bf16_is_verls_merger_bit_for_bit(verl_cases, tmp_path, name):
    case = verl_cases[name]
    got = rewrite(case["actor"], tmp_path / "out", "--dtype", "bf16")
    assert_bitwise(got, load_file(case["merged"] / "model.safetensors"))


@pytest.mark.parametrize("name", PLAIN)
def test_lossless_is_the_trained_model(verl_cases, tmp_path, name):
    """By default the stored dtype (fp32 masters), every tensor equal to torch's own gather of
    the trained model; a tied head left out as save_pretrained does, kept with --keep-tied."""
    case = verl_cases[name]
    live = torch.load(case["live"], weights_only=True)
    got = rewrite(case["actor"], tmp_path / "out")
    tied = json.loads((case["actor"] / "huggingface" / "config.json").read_text()).get("tie_word_embeddings")
    assert_bitwise(got, {k: v for k, v in live.items() if not (tied and k == "lm_head.weight")})
    if tied:
        assert_bitwise(rewrite(case["actor"], tmp_path / "kept", "--keep-tied"), live)


@pytest.mark.parametrize("name", PLAIN)
def test_output_loads_with_the_trained_models_logits(verl_cases, tmp_path, name):
    from transformers import AutoConfig, AutoModelForCausalLM

    case = verl_cases[name]
    out = tmp_path / "out"
    rewrite(case["actor"], out)
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    trained = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(case["actor"] / "huggingface")).float()
    trained.load_state_dict(torch.load(case["live"], weights_only=True), strict=False)
    ids = torch.arange(40).reshape(2, 20) * 37 % 320
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, trained(input_ids=ids).logits)


def test_every_entry_point_reads_the_same_model(verl_cases, tmp_path):
    """The actor folder, global_step_N/, and the run root with --step N or latest (as
    latest_checkpointed_iteration.txt says) read the same; the notes name what is left out."""
    case = verl_cases["fsdp2_tied_w3"]
    want = rewrite(case["actor"], tmp_path / "a")
    assert_bitwise(rewrite(case["step"], tmp_path / "b"), want)
    assert_bitwise(rewrite(case["run"], tmp_path / "c", "--step", "latest"), want)
    proc = cli("rewrite", case["run"], "--step", "1", "-o", tmp_path / "d", check=0)
    assert_bitwise(load_file(tmp_path / "d" / "model.safetensors"), want)
    for left in ("optim_world_size", "extra_state_world_size", "data.pt"):
        assert left in proc.stderr
    root = cli("ls", case["run"], check=0)  # a bare run root: read at its latest step, said in a note
    assert "global_step_1" in root.stderr and "model.embed_tokens.weight" in root.stdout


def test_hsdp_reads_one_replica(verl_cases):
    """HSDP's ("ddp", "fsdp") mesh: Replicate on ddp, Shard(0) on fsdp; four rank files, each
    tensor from the two of the first replica."""
    from streamck.source.checkpoint import open_checkpoint

    actor = verl_cases["fsdp2_untied_hsdp_w4"]["actor"]
    ckpt = open_checkpoint(actor)
    first = {actor / f"model_world_size_4_rank_{r}.pt" for r in (0, 1)}
    assert all(set(t.paths) == first for t in ckpt.tensors.values() if t.shape[0] > 1)
    assert len(ckpt.files) == 4  # every rank file checked for changes during the run


def copy_actor(case: dict, tmp_path: Path) -> Path:
    actor = tmp_path / "actor"
    shutil.copytree(case["actor"], actor)
    return actor


def refused(src, tmp_path: Path, *words: str) -> str:
    """``rewrite src`` exits 2 with one line holding ``words``, nothing at the output."""
    out = tmp_path / "out"
    proc = cli("rewrite", src, "-o", out, check=2)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert all(w in lines[0] for w in words), lines[0]
    assert not out.exists()
    return lines[0]


def test_missing_rank_is_named(verl_cases, tmp_path):
    actor = copy_actor(verl_cases["fsdp2_tied_w3"], tmp_path)
    (actor / "model_world_size_3_rank_1.pt").unlink()
    refused(actor, tmp_path, "model_world_size_3_rank_1.pt", "missing")


def test_extra_rank_is_named(verl_cases, tmp_path):
    actor = copy_actor(verl_cases["fsdp1_untied_w2"], tmp_path)
    shutil.copy(actor / "model_world_size_2_rank_0.pt", actor / "model_world_size_2_rank_2.pt")
    refused(actor, tmp_path, "model_world_size_2_rank_2.pt", "extra")


def test_world_size_disagreeing_with_fsdp_config_is_named(verl_cases, tmp_path):
    actor = copy_actor(verl_cases["fsdp1_untied_w2"], tmp_path)
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 1, "world_size": 3}))
    refused(actor, tmp_path, "model_world_size_2_rank_0.pt", "world_size 3")


def test_a_rank_file_alone_is_refused_naming_its_folder(verl_cases, tmp_path):
    actor = verl_cases["fsdp2_tied_w3"]["actor"]
    refused(actor / "model_world_size_3_rank_0.pt", tmp_path, "give its folder", str(actor))


def test_lora_actor_is_refused_naming_why(verl_cases, tmp_path):
    refused(verl_cases["fsdp2_lora_w2"]["actor"], tmp_path, "LoRA", "lora_")


def test_a_pickle_naming_other_code_is_refused():
    """The rank files' pickles are read under an allow-list: a global outside it is refused, never called."""
    import pickle

    from streamck.source.verl.ranks import _VerlPickle

    for evil in (b"cos\nsystem\n(S'true'\ntR.", b"ctorch.distributed.tensor\nDTensor\n(tR."):
        with pytest.raises(pickle.UnpicklingError):
            _VerlPickle(evil).load()
