"""Lightning 2.6 checkpoints (issue 34), written by Lightning's own Trainer and Fabric under
torchrun on CPU/gloo (tests/lightning_fixtures.py: DDP, FSDP sharded and full, ModelParallel,
Fabric). Oracles: ``torch.load(weights_only=True)`` and Lightning's ``consolidate_checkpoint``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import cli, fixture_root

torch = pytest.importorskip("torch")
pytest.importorskip("lightning", reason="lightning==2.6.1 (scripts/test installs it)")
from safetensors.torch import load_file  # noqa: E402

MODEL = ["net.0.bias", "net.0.weight", "net.2.bias", "net.2.weight"]


@pytest.fixture(scope="session")
def lit(request, tmp_path_factory) -> Path:
    from lightning_fixtures import make_lightning_checkpoints

    root = fixture_root(tmp_path_factory, "lightning", "tests/lightning_fixtures.py", "tests/trainer_fixtures.py")
    return make_lightning_checkpoints(root)


@pytest.fixture(scope="session")
def consolidated(lit, tmp_path_factory) -> dict[str, dict]:
    """Lightning's own consolidate_checkpoint of each sharded Trainer checkpoint, loaded. (It
    refuses ModelParallelStrategy's, KeyError 'model': that one is checked against live.pt.)"""
    out = {}
    for name in ("fsdp_sharded",):
        dst = tmp_path_factory.mktemp("consolidated") / f"{name}.ckpt"
        cmd = [sys.executable, "-m", "lightning.pytorch.utilities.consolidate_checkpoint", str(lit / f"{name}.ckpt"),
               "--output_file", str(dst)]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, timeout=300)
        out[name] = torch.load(dst, weights_only=False)
    return out


def _rewrite(src: Path, out: Path, *args) -> tuple[dict, str]:
    r = cli("rewrite", src, "-o", out, "--verify", *args, check=0)
    return load_file(out), r.stderr


def _same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_fsdp_full_state_dict_ckpt_is_read(lit, tmp_path):
    # torch's FSDP full state dict sets _has_been_cloned on every tensor: read as inert data
    got, err = _rewrite(lit / "fsdp_full.ckpt", tmp_path / "m.safetensors")
    _same(got, torch.load(lit / "fsdp_full.ckpt", weights_only=True)["state_dict"])
    _same(got, torch.load(lit / "fsdp_full.live.pt"))
    assert "read the model: 4 tensors under 'state_dict'" in err


@pytest.mark.parametrize("name", ["ddp", "fsdp_full"])
def test_ckpt_takes_the_model_and_leaves_the_training_state(lit, tmp_path, name):
    src = lit / f"{name}.ckpt"
    got, err = _rewrite(src, tmp_path / "m.safetensors")
    assert sorted(got) == MODEL  # no optimizer_states.*, no callbacks.ModelCheckpoint{...}.kth_value
    _same(got, torch.load(src, weights_only=True)["state_dict"])
    assert "left out: callbacks (1 tensor), optimizer_states (12 tensors); --key '*' reads every group" in err
    every = json.loads(cli("ls", src, "--key", "*", "--json", check=0).stdout)["tensors"]
    assert "state_dict.net.0.weight" in every and "optimizer_states.0.state.0.exp_avg" in every


@pytest.mark.parametrize("name", ["ddp", "mp"])
def test_dotted_key_is_one_rule_for_ckpt_and_dcp(lit, tmp_path, name):
    got, _ = _rewrite(lit / f"{name}.ckpt", tmp_path / "m.safetensors", "--key", "state_dict.net")
    assert sorted(got) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    _same(got, {k.removeprefix("net."): v for k, v in torch.load(lit / f"{name}.live.pt").items()})


@pytest.mark.parametrize("name", ["fsdp_sharded", "mp"])
def test_sharded_trainer_checkpoint_equals_consolidate_checkpoint(lit, consolidated, tmp_path, name):
    got, err = _rewrite(lit / f"{name}.ckpt", tmp_path / "m.safetensors")
    _same(got, consolidated[name]["state_dict"] if name in consolidated else torch.load(lit / f"{name}.live.pt"))
    group = "model" if name == "fsdp_sharded" else "state_dict"
    assert f"read the model: 4 tensors under '{group}'" in err and "optimizer_0 12 tensors" in err


def test_fabric_save_reads_as_the_model(lit, tmp_path):
    got, err = _rewrite(lit / "fabric.ckpt", tmp_path / "m.safetensors")
    _same(got, torch.load(lit / "fabric.live.pt"))
    assert "left out: optimizer 12 tensors" in err


def test_readme_row_gives_hf_names(lit, tmp_path):
    # the README's Lightning row: --key state_dict --strip-prefix <the module's attribute>.
    got, _ = _rewrite(lit / "ddp.ckpt", tmp_path / "m.safetensors", "--key", "state_dict", "--strip-prefix", "net.")
    assert sorted(got) == ["0.bias", "0.weight", "2.bias", "2.weight"]


def test_tensor_attributes_other_than_plain_values_are_refused(tmp_path):
    t = torch.ones(2)
    t._plain = True
    torch.save({"w": t}, tmp_path / "ok.pt")
    assert cli("ls", tmp_path / "ok.pt", check=0).stdout.startswith("NAME")
    t._nested = {"a": 1}  # a container: not a plain value
    torch.save({"w": t}, tmp_path / "nested.pt")
    r = cli("ls", tmp_path / "nested.pt")
    assert r.returncode == 2 and "are not a dict of plain values" in r.stderr and r.stderr.count("\n") == 1
