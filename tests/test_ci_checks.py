"""Issue #43: key-set checks as teams wire them, and a newcomer's second list: ``diff -q`` quiet,
``--strict`` casts, whole-file digests in ``hash --json`` (the Hub's LFS oids), partial ``--part``
outputs named as such, writing into a Hub repo clone, and hints that lead somewhere."""

from __future__ import annotations

import hashlib
import json
import subprocess

import numpy as np
from helpers import cli, save, save_sharded


def _model(tmp_path, name="m.safetensors", scale=1.0):
    rng = np.random.default_rng(0)
    tensors = {f"layers.{i}.w": (rng.standard_normal((8, 8)) * scale).astype(np.float32) for i in range(6)}
    return save(tmp_path / name, tensors), tensors


def test_diff_quiet_prints_nothing_when_the_sides_agree(tmp_path):
    a, _ = _model(tmp_path, "a.safetensors")
    b, _ = _model(tmp_path, "b.safetensors", scale=2.0)
    same = cli("diff", "-q", a, a, check=0)
    assert same.stdout == "" and same.stderr == ""
    differs = cli("diff", "-q", a, b, "--data", check=1)  # a difference is still reported
    assert "data changed (6):" in differs.stdout


def test_strict_makes_an_overflowing_cast_an_error_and_writes_nothing(tmp_path):
    src = save(tmp_path / "big.safetensors", {"w": np.array([1.0, 1e5, -7e4], dtype=np.float32)})
    loose = cli("rewrite", src, "-o", tmp_path / "loose.safetensors", "--dtype", "fp16", check=0)
    assert "w: 2 finite values became inf in the cast" in loose.stderr
    out = tmp_path / "strict.safetensors"
    strict = cli("rewrite", src, "-o", out, "--dtype", "fp16", "--strict", check=2)
    assert strict.stderr.strip().splitlines() == [
        "streamck: error: --strict: finite values became inf in the cast of 1 tensors: w (2)"
    ]
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["big.safetensors", "loose.safetensors"]
    cli("rewrite", src, "-o", out, "--dtype", "bf16", "--strict", check=0)  # bf16 holds them: no error


def test_hash_json_carries_whole_file_digests_equal_to_sha256sum(tmp_path):
    _, tensors = _model(tmp_path)
    src = save_sharded(tmp_path / "ck", tensors, 3)
    manifest = json.loads(cli("hash", "--json", src, check=0).stdout)
    shards = sorted(p.name for p in src.glob("*.safetensors"))
    assert sorted(manifest["files"]) == shards
    summed = subprocess.run(["sha256sum", *shards], cwd=src, capture_output=True, text=True, check=True).stdout
    for line in summed.splitlines():
        digest, name = line.split()
        assert manifest["files"][name] == {"sha256": digest, "size": (src / name).stat().st_size}


def test_diff_against_a_hash_manifest_reports_a_changed_file(tmp_path):
    _, tensors = _model(tmp_path)
    src = save_sharded(tmp_path / "ck", tensors, 2)
    golden = tmp_path / "golden.json"
    cli("hash", "--json", src, "-o", golden, check=0)
    assert cli("diff", golden, src, check=0).stdout.splitlines()[-1].endswith("sha256 and whole files")
    # the same tensors, another header: only a whole-file digest sees it
    shard = src / "model-00002-of-00002.safetensors"
    body = {k: tensors[k] for k in sorted(tensors)[1::2]}
    save(shard, body, metadata={"format": "pt", "note": "re-saved"})
    report = cli("diff", golden, src, check=1).stdout
    assert "file changed (1):\n  ! model-00002-of-00002.safetensors" in report
    assert "digest changed" not in report
    assert json.loads(cli("diff", "--json", golden, src, check=1).stdout)["file_changed"] == [shard.name]


def test_a_partial_part_output_is_named_incomplete_and_refused(tmp_path):
    src, _ = _model(tmp_path)
    out = tmp_path / "out"
    part = cli("rewrite", src, "-o", out, "--max-shard-size", "600", "--part", "1/3", check=0)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    total = len(list(out.glob("*.safetensors")))
    assert 0 < total < 6 and not (out / "model.safetensors.index.json").exists()
    written = sum(len(json.loads(cli("ls", "--json", out / s, check=0).stdout)["tensors"]) for s in shards)
    assert f"part 1/3: {total} shards, {written} of 6 tensors" in part.stderr
    for command in (["ls", out], ["hash", out], ["diff", out, src], ["rewrite", out, "-o", tmp_path / "x"]):
        refused = cli(*command, check=2).stderr.strip().splitlines()
        assert len(refused) == 1 and "incomplete:" in refused[0] and "shards missing (model-0000" in refused[0]
        assert "and no index" in refused[0], refused
    assert not (tmp_path / "x").exists()
    for k in (2, 3):
        cli("rewrite", src, "-o", out, "--max-shard-size", "600", "--part", f"{k}/3", check=0)
    cli("diff", out, src, "--data", check=0)


def test_rewrite_into_a_hub_repo_clone_keeps_its_git_files(tmp_path):
    src, _ = _model(tmp_path)
    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    (repo / "README.md").write_text("---\nlicense: apache-2.0\n---\n# my model\n")
    before = {p: p.read_bytes() for p in repo.rglob("*") if p.is_file()}
    refused = cli("rewrite", src, "-o", repo, check=2).stderr
    assert "already exists; pass --force" in refused
    cli("rewrite", src, "-o", repo, "--force", check=0)
    assert all(p.read_bytes() == data for p, data in before.items())
    cli("diff", repo, src, "--data", check=0)
    # without .git/ a README.md is someone's file all the same: kept, as every file that is no export's (#54)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "README.md").write_text("notes\n")
    cli("rewrite", src, "-o", plain, "--force", check=0)
    assert (plain / "README.md").read_text() == "notes\n"


def test_a_mistyped_plan_gets_the_closest_and_the_list(tmp_path):
    src, _ = _model(tmp_path)
    err = cli("rewrite", src, "-o", tmp_path / "o", "--plan", "torchtitn", check=2).stderr.strip()
    assert err.startswith("streamck: error: --plan torchtitn: no such built-in plan or plan file; ")
    assert "; did you mean torchtitan? the built-in plans: " in err
    assert "megatron-gpt" in err and "eagle4" in err and len(err.splitlines()) == 1


def test_a_hub_cache_miss_names_hf_download(tmp_path):
    err = cli("ls", "nobody/no-such-model", env={"HF_HUB_CACHE": str(tmp_path)}, check=2).stderr
    assert "run `hf download nobody/no-such-model` first" in err and "huggingface-cli" not in err


def test_hash_manifest_files_are_relative_to_the_checkpoint(tmp_path):
    src, _ = _model(tmp_path)
    manifest = json.loads(cli("hash", "--json", src, check=0).stdout)
    assert manifest["files"] == {
        "m.safetensors": {"sha256": hashlib.sha256(src.read_bytes()).hexdigest(), "size": src.stat().st_size}
    }


SGD_RUN = """
import sys, torch, lightning.pytorch as pl

class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 2)
    def training_step(self, batch, _):
        return self.net(batch[0]).pow(2).mean()
    def configure_optimizers(self):  # plain SGD keeps no state: optimizer_states holds no tensor
        return torch.optim.SGD(self.parameters(), lr=0.1)
    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)

trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Tiny())
trainer.save_checkpoint(sys.argv[1])
"""


def test_lightning_model_group_note_names_stateless_training_state(tmp_path):
    """A Lightning Trainer's own .ckpt of a plain-SGD run: the note says what was left out."""
    import sys

    ckpt = tmp_path / "last.ckpt"
    subprocess.run(["timeout", "300", sys.executable, "-c", SGD_RUN, str(ckpt)], check=True, capture_output=True)
    err = cli("rewrite", ckpt, "-o", tmp_path / "m.safetensors", check=0).stderr
    assert "read the model: 2 tensors under 'state_dict'" in err and "left out: ;" not in err
    assert "left out: loops, callbacks, optimizer_states, lr_schedulers (no tensors); --key '*'" in err, err
