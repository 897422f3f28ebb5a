"""DeepSpeed ZeRO checkpoints as a source: the CLI's rewrite of a Trainer checkpoint-N/
equals zero_to_fp32's own output (frozen params and buffers included), and the choice
between a weights file and the ZeRO state beside it is said."""

from __future__ import annotations

import os
import shutil

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed  # noqa: F401  a test dependency: missing, the suite fails rather than skips
import torch
import zero_fixtures
from fixture_cache import built_once, fixture_root
from helpers import cli
from safetensors.torch import load_file, save_file

from streamck import CheckpointError, open_checkpoint


def expected(case) -> dict:
    """zero_to_fp32's state dict, plus the frozen params it leaves out of ZeRO-1 (from the module)."""
    oracle = torch.load(case["oracle"], weights_only=True)
    module = torch.load(case["module"], weights_only=True)
    low = torch.bfloat16 if case["dtype"] == "bf16" else torch.float32
    for name in zero_fixtures.FROZEN:
        oracle.setdefault(name, module[name].to(low))
    return oracle


@pytest.mark.parametrize("name", [c["name"] for c in zero_fixtures.cases()])
def test_rewrite_equals_zero_to_fp32(zero_cases, tmp_path, name):
    case = zero_cases[name]
    r = cli("rewrite", case["checkpoint"], "-o", tmp_path / "out.safetensors", "--verify", "-q")
    assert r.returncode == 0, r.stderr
    got, want = load_file(tmp_path / "out.safetensors"), expected(case)
    assert sorted(got) == sorted(want)
    for n, t in want.items():
        assert got[n].dtype == t.dtype and torch.equal(got[n], t), n


def test_step_dir_run_root_and_casts(zero_cases, tmp_path):
    case = zero_cases["z3_w2_fp32"]
    run = tmp_path / "run"
    shutil.copytree(case["checkpoint"], run / "checkpoint-1")
    for src, extra in ((case["step_dir"], ()), (run, ("--step", "latest"))):
        r = cli("rewrite", src, *extra, "-o", tmp_path / "o.safetensors", "--dtype", "bf16", "--force", "-q")
        assert r.returncode == 0, r.stderr
        got = load_file(tmp_path / "o.safetensors")
        for n, t in expected(case).items():
            assert torch.equal(got[n], t.to(torch.bfloat16) if t.is_floating_point() else t), n


def test_directory_output_leaves_the_recovery_scripts(zero_cases, tmp_path):
    case = zero_cases["z3_w2_fp32"]
    ckpt = tmp_path / "checkpoint-1"
    shutil.copytree(case["checkpoint"], ckpt)
    (ckpt / "config.json").write_text("{}")
    assert {"zero_to_fp32.py", "zero_to_torch.py"} <= {p.name for p in ckpt.iterdir()}  # DeepSpeed's copies
    r = cli("rewrite", ckpt, "-o", tmp_path / "out", "-q")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]


def test_complete_weights_are_the_default_and_zero_takes_the_master(zero_cases, tmp_path):
    case = zero_cases["z2_w2_bf16"]
    ckpt = tmp_path / "checkpoint-1"
    shutil.copytree(case["checkpoint"], ckpt)
    want = expected(case)
    save_file(
        {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in want.items()}, ckpt / "model.safetensors"
    )
    r = cli("ls", ckpt)
    assert r.returncode == 0 and "--zero reads its fp32 master weights" in r.stderr
    assert open_checkpoint(ckpt).tensors["embed.weight"].dtype == "BF16"
    assert open_checkpoint(ckpt, zero=True).tensors["embed.weight"].dtype == "F32"
    r = cli("rewrite", ckpt, "--zero", "-o", tmp_path / "o.safetensors", "-q")
    assert r.returncode == 0, r.stderr
    assert torch.equal(load_file(tmp_path / "o.safetensors")["embed.weight"], want["embed.weight"])
    with pytest.raises(CheckpointError, match="no DeepSpeed ZeRO state"):
        open_checkpoint(case["oracle"].parent / "module.pt", zero=True)


def test_missing_rank_file_is_one_line(zero_cases, tmp_path):
    ckpt = tmp_path / "checkpoint-1"
    shutil.copytree(zero_cases["z3_w3_fp32"]["checkpoint"], ckpt)
    next((ckpt / "global_step1").glob("*rank_1_*optim_states.pt")).unlink()
    r = cli("rewrite", ckpt, "-o", tmp_path / "out")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_a_rank_file_with_a_bad_crc_is_one_line(zero_cases, tmp_path):
    import zipfile

    ckpt = tmp_path / "checkpoint-1"
    shutil.copytree(zero_cases["z3_w2_fp32"]["checkpoint"], ckpt)
    rank = next((ckpt / "global_step1").glob("*rank_1_*optim_states.pt"))
    info = next(i for i in zipfile.ZipFile(rank).infolist() if i.filename.endswith("data.pkl"))
    raw = bytearray(rank.read_bytes())
    name, extra = (
        int.from_bytes(raw[info.header_offset + 26 : info.header_offset + 28], "little"),
        int.from_bytes(raw[info.header_offset + 28 : info.header_offset + 30], "little"),
    )
    raw[info.header_offset + 30 + name + extra + info.file_size // 2] ^= 0xFF  # inside the pickle's bytes
    rank.write_bytes(bytes(raw))
    r = cli("ls", ckpt)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr


@pytest.fixture(scope="module")
def odd_steps(tmp_path_factory):
    """Made once and kept on the machine, as zero_cases is: DeepSpeed's spawn took ~100 s a run."""
    root = fixture_root(tmp_path_factory, "zero-odd", "tests/zero_fixtures.py")
    base = built_once(root / "steps", zero_fixtures.make_odd_checkpoints)
    steps = {stage: base / f"z{stage}" / "global_step1" for stage in (1, 2)}
    return {**steps, "lightning": base / "epoch=0-step=1.ckpt"}


def test_notices_for_a_param_of_no_elements_and_an_f64_buffer(odd_steps):
    for stage in (1, 2):
        step = odd_steps[stage]
        ckpt = open_checkpoint(step)
        notes = " | ".join(ckpt.notices)
        assert ckpt.tensors["empty"].shape == (0,) and ckpt.tensors["f64"].dtype == "F64"
        assert "frozen" not in notes, notes  # trainable: ZeRO-1 leaves it out of its partitions, ZeRO-2 does not
        assert ("params with no elements empty" in notes) == (stage == 1), notes
        assert "f64 are kept as saved (F64); zero_to_fp32 makes every floating buffer F32" in notes, notes
        r = cli("ls", step)
        assert r.returncode == 0 and ". (+-1 more)" not in r.stdout, r.stdout


def test_lightning_client_state_is_inert_data(odd_steps, tmp_path):
    for needed in ("lightning", "omegaconf"):
        pytest.importorskip(needed, reason=f"{needed} (installed by scripts/test) makes this fixture")
    ckpt = odd_steps["lightning"]
    r = cli("rewrite", ckpt, "-o", tmp_path / "out.safetensors")
    assert r.returncode == 0, r.stderr
    assert "client state objects argparse.Namespace, lightning.fabric.utilities.data.AttributeDict" in r.stderr
    assert "read as inert data, never run" in r.stderr
    assert "omegaconf.dictconfig.DictConfig" in r.stderr  # Hydra's config in the hyperparameters
    assert sorted(load_file(tmp_path / "out.safetensors")) == ["empty", "f64", "lin.bias", "lin.weight"]
    assert open_checkpoint(ckpt).root == ckpt / "checkpoint"  # the tag Lightning saves under
