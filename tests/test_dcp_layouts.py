"""Layouts torch writes that a reader must take as they are (issue 24, items 5 and 6):
several chunks of one tensor in one file, per-rank metadata, megatron-core's save plans
in .metadata, a Python 3.13 pickle. Fixtures: tests/dcp_trainers.py, torch's own writers."""

import pickle
import shutil
import subprocess
import sys
import types
from pathlib import Path, PurePath

import pytest
import torch
from dcp_trainers import torch_oracle
from helpers import cli
from safetensors.torch import load_file

from streamck import CheckpointError, open_checkpoint


def torch_metadata(path: Path):
    import torch.distributed.checkpoint  # noqa: F401  (the classes pickle.load needs)

    with open(path, "rb") as f:
        return pickle.load(f)


def rewritten(src: Path, tmp_path: Path, *args: str) -> dict[str, torch.Tensor]:
    out = tmp_path / "out.safetensors"
    cli("rewrite", src, "-o", out, "--verify", *args, check=0)
    return load_file(out)


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def test_several_chunks_of_one_tensor_in_one_file(dcp_trainers, tmp_path):
    src = dcp_trainers["multi"]
    md = torch_metadata(src / ".metadata")
    files = [i.relative_path for k, i in md.storage_data.items() if k.fqn == "table.weight"]
    assert len(files) == 8 and len(set(files)) == 4  # two column blocks in each rank's file
    assert_same(rewritten(src, tmp_path), torch_oracle(src, tmp_path / "oracle.pt"))


def test_megatron_all_local_plans_are_inert_data(dcp_trainers, tmp_path):
    src = dcp_trainers["plans"]
    md = torch_metadata(src / ".metadata")
    assert len(md.all_local_plans) == 4 and type(md.all_local_plans[0]).__name__ == "SavePlan"
    assert_same(rewritten(src, tmp_path), torch_oracle(src, tmp_path / "oracle.pt"))


def _fake_global(monkeypatch, module: str, name: str, obj) -> None:
    """Make ``module.name`` resolve to ``obj`` while pickling, so the pickle names it as
    the real producer's pickle does (megatron-core, Python 3.13), not installed here."""
    obj.__module__, obj.__qualname__ = module, name
    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        mod = sys.modules.get(".".join(parts[:i])) or types.ModuleType(".".join(parts[:i]))
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setattr(sys.modules[module], name, obj, raising=False)


def repickle(path: Path, edit=lambda md: None, reduce=lambda obj: NotImplemented) -> None:
    """Rewrite torch's pickle at ``path``: ``edit`` the Metadata, ``reduce(obj)`` overrides
    how objects pickle."""

    class Pickler(pickle.Pickler):
        def reducer_override(self, obj):
            return reduce(obj)

    md = torch_metadata(path)
    edit(md)
    with open(path, "wb") as f:
        Pickler(f, protocol=2).dump(md)


def test_megatron_save_plans_by_their_class_name(dcp_trainers, tmp_path, monkeypatch):
    src = Path(shutil.copytree(dcp_trainers["plans"], tmp_path / "plans"))

    class MCoreSavePlan:  # megatron-core's SavePlan subclass, with its per-tensor mcore_data
        pass

    _fake_global(monkeypatch, "megatron.core.dist_checkpointing.strategies.torch", "MCoreSavePlan", MCoreSavePlan)

    def mcore(plan):
        out = MCoreSavePlan()
        out.__dict__.update(vars(plan), mcore_data={"table.weight": {"nd_reformulated_orig_global_shape": (8, 32)}})
        return out

    repickle(src / ".metadata", lambda md: setattr(md, "all_local_plans", [mcore(p) for p in md.all_local_plans]))
    assert b"megatron.core.dist_checkpointing.strategies.torch\nMCoreSavePlan" in (src / ".metadata").read_bytes()
    assert open_checkpoint(src).tensors["table.weight"].shape == (8, 32)


def test_python_313_path_in_metadata(dcp_trainers, tmp_path, monkeypatch):
    src = Path(shutil.copytree(dcp_trainers["fsdp2"], tmp_path / "fsdp2"))
    assert isinstance(torch_metadata(src / ".metadata").storage_meta.checkpoint_id, PurePath)
    code = "import pathlib, pickle, sys; sys.stdout.buffer.write(pickle.dumps(pathlib.PosixPath('/x'), 2))"
    for py313 in Path("/root/.pyenv/versions").glob("3.13*/bin/python"):  # the premise, where 3.13 is at hand
        assert b"cpathlib._local\nPosixPath\n" in subprocess.run([py313, "-c", code], capture_output=True).stdout

    def posix_path(*parts):
        raise AssertionError("never called while pickling")

    _fake_global(monkeypatch, "pathlib._local", "PosixPath", posix_path)
    as_313 = lambda obj: (posix_path, (str(obj),)) if isinstance(obj, PurePath) else NotImplemented  # noqa: E731
    repickle(src / ".metadata", reduce=as_313)
    assert b"cpathlib._local\nPosixPath\n" in (src / ".metadata").read_bytes()
    want = open_checkpoint(dcp_trainers["fsdp2"]).tensors
    assert open_checkpoint(src).tensors.keys() == want.keys()


def test_per_rank_metadata(dcp_trainers, tmp_path):
    src = dcp_trainers["percoll"]
    assert not (src / ".metadata").exists()
    assert sorted(p.name for p in src.glob("__*.metadata")) == [f"__{r}.metadata" for r in range(4)]
    # every rank saved the replicated bias: it is read once, from rank 0
    assert all("model.b" in torch_metadata(p).state_dict_metadata for p in src.glob("__*.metadata"))
    ckpt = open_checkpoint(src)
    assert [t.path.name for t in ckpt.tensors["model.b"].tiles] == ["__0_0.distcp"]
    assert_same(rewritten(src, tmp_path), torch.load(dcp_trainers["percoll.reference"]))


def test_per_rank_metadata_missing_a_rank(dcp_trainers, tmp_path):
    src = Path(shutil.copytree(dcp_trainers["percoll"], tmp_path / "percoll"))
    (src / "__2.metadata").unlink()
    with pytest.raises(CheckpointError, match=r"per-rank metadata __2.metadata missing \(have ranks \[0, 1, 3\]\)"):
        open_checkpoint(src)
    r = cli("rewrite", src, "-o", tmp_path / "out")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and not (tmp_path / "out").exists()
