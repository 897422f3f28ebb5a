"""The command line, run as a user runs it: in a child process."""

import json
import re
import subprocess
import sys

import numpy as np
import pytest
from helpers import cli, llama_like, raw_file, read_all, save, save_sharded


@pytest.fixture
def ckpt(tmp_path):
    return save_sharded(tmp_path / "ck", llama_like(), 2)


def test_ls_table_and_totals(ckpt):
    out = cli("ls", ckpt, check=0).stdout
    assert re.search(r"^model.layers.1.mlp.up_proj.weight +F32 +\[16, 8\] +512 +model-0000", out, re.M)
    assert "model-00002-of-00002.safetensors" in out
    assert out.strip().splitlines()[-1].startswith("13 tensors in 2 file(s)")


def test_ls_json_manifest(ckpt):
    manifest = json.loads(cli("ls", ckpt, "--json", check=0).stdout)
    tensors = llama_like()
    assert manifest["tensors"] == {
        k: {"dtype": {"float32": "F32", "float16": "F16", "int64": "I64"}[str(v.dtype)], "shape": list(v.shape)}
        for k, v in tensors.items()
    }
    assert manifest["total_size"] == sum(v.nbytes for v in tensors.values())
    assert manifest["metadata"] == {"format": "pt"}
    assert list(manifest) == sorted(manifest)


def test_rewrite_strip_and_drop(ckpt, tmp_path):
    cli("rewrite", ckpt, "-o", tmp_path / "out", "--strip-prefix", "model.", "--drop", "*.rotary_emb.inv_freq", check=0)
    got = read_all(tmp_path / "out" / "model.safetensors")
    src = llama_like()
    expected = {k.removeprefix("model."): v for k, v in src.items() if not k.endswith("inv_freq")}
    assert sorted(got) == sorted(expected)
    assert all(np.array_equal(got[k], expected[k]) for k in got)


def test_rule_order_follows_the_command_line(ckpt, tmp_path):
    a = cli("rewrite", ckpt, "--dry-run", "--json", "--rename", "^model=m", "--rename", "^m\\.=x.", check=0)
    b = cli("rewrite", ckpt, "--dry-run", "--json", "--rename", "^m\\.=x.", "--rename", "^model=m", check=0)
    assert "x.norm.weight" in json.loads(a.stdout)["tensors"]
    assert "m.norm.weight" in json.loads(b.stdout)["tensors"]


def test_dry_run_writes_nothing(ckpt, tmp_path):
    out = cli(
        "rewrite", ckpt, "-o", tmp_path / "o.safetensors", "--dry-run", "--strip-prefix", "model.", check=0
    ).stdout
    assert re.search(r"^model.norm.weight +norm.weight +F16 +\[8\] +16$", out, re.M)
    assert "13 tensors (0 dropped)" in out
    assert not (tmp_path / "o.safetensors").exists()


def test_plan_file(ckpt, tmp_path):
    (tmp_path / "p.toml").write_text('rules = [{keep = "model.layers.0.*"}, {strip_prefix = "model.layers.0."}]\n')
    manifest = json.loads(cli("rewrite", ckpt, "--plan", tmp_path / "p.toml", "--dry-run", "--json", check=0).stdout)
    assert sorted(manifest["tensors"]) == [
        "input_layernorm.weight",
        "mlp.up_proj.weight",
        "self_attn.q_proj.weight",
        "self_attn.rotary_emb.inv_freq",
        "step",
    ]


@pytest.mark.parametrize(
    ("make", "args", "message"),
    [
        (lambda d: raw_file(d / "b.safetensors", b"{", length=100), ["ls"], "runs past the end"),
        (
            lambda d: save(d / "s.safetensors", {"model.a": np.zeros(1), "a": np.zeros(1)}),
            ["rewrite", "-o", "OUT", "--strip-prefix", "model."],
            "collide",
        ),
        (
            lambda d: save(d / "s.safetensors", {"a": np.zeros(1)}),
            ["rewrite", "-o", "OUT", "--rename", "(=x"],
            "--rename",
        ),
        (lambda d: d / "missing", ["ls"], "no such file"),
    ],
)
def test_errors_are_one_line_exit_2_no_output(tmp_path, make, args, message):
    src = make(tmp_path)
    cmd, *rest = args
    out = tmp_path / "out"
    proc = cli(cmd, src, *[out if a == "OUT" else a for a in rest])
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("streamck: error: ")
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()


def test_existing_output_refused_then_forced(tmp_path):
    src = save(tmp_path / "s.safetensors", {"a": np.ones(3)})
    (tmp_path / "o.safetensors").write_bytes(b"keep me")
    proc = cli("rewrite", src, "-o", tmp_path / "o.safetensors")
    assert proc.returncode == 2 and "--force" in proc.stderr
    assert (tmp_path / "o.safetensors").read_bytes() == b"keep me"
    cli("rewrite", src, "-o", tmp_path / "o.safetensors", "--force", check=0)


def test_ls_and_plain_rewrite_never_import_torch(ckpt, tmp_path):
    code = (
        "import sys; from streamck.cli import main\n"
        f"assert main(['ls', {str(ckpt)!r}, '--json']) == 0\n"
        "late = {'streamck.writer', 'streamck.plan', 'streamck.api'} & set(sys.modules)\n"
        "assert not late, f'ls imported {late}'\n"
        f"assert main(['rewrite', {str(ckpt)!r}, '-o', {str(tmp_path / 'o')!r}, '--strip-prefix', 'model.']) == 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_every_writer_flag_reaches_the_writer(ckpt, tmp_path, monkeypatch):
    import streamck.api  # noqa: F401 -- imported first: it binds write_plan, which must stay the real one
    import streamck.cli as cli

    seen = {}

    def fake_rewrite(plan, out, options):  # the options arrive as one WriteOptions (#49)
        from dataclasses import asdict

        seen.update({k: v for k, v in asdict(options).items() if k not in ("chunk", "outtype")}, out=out)
        raise SystemExit(0)

    monkeypatch.setattr("streamck.writer.write_plan", fake_rewrite)
    with pytest.raises(SystemExit):
        cli.main(
            [
                "rewrite",
                str(ckpt),
                "-o",
                str(tmp_path / "o"),
                "--max-shard-size",
                "2KiB",
                "--header-align",
                "64",
                "--force",
                "--drop-cache",
                "--device",
                "cpu",
                "--verify",
                "--format",
                "torch",
                "--jobs",
                "3",
                "--part",
                "2/5",
                "--keep-shards",
                "--progress",
                "log",
                "--strict",
            ]
        )
    assert seen == {
        "out": str(tmp_path / "o"),
        "max_shard_size": 2048,
        "header_align": 64,
        "force": True,
        "drop_cache": True,
        "device": "cpu",
        "verify": True,
        "strict": True,
        "progress": "log",
        "format": "torch",
        "jobs": 3,
        "part": (2, 5),
        "keep_shards": True,
        "group_size": None,  # --format mlx's and megatron's own (refused with torch): tests/test_mlx.py
        "make_vocab_size_divisible_by": None,
    }


def test_header_align_from_the_cli(ckpt, tmp_path):
    cli("rewrite", ckpt, "-o", tmp_path / "o.safetensors", "--header-align", "4096", check=0)
    data = (tmp_path / "o.safetensors").read_bytes()
    assert (8 + int.from_bytes(data[:8], "little")) % 4096 == 0
    assert sorted(read_all(tmp_path / "o.safetensors")) == sorted(llama_like())


@pytest.mark.parametrize(
    "args", [[], ["--bogus"], ["diff", "a"], ["rewrite", "x", "-o", "y", "--max-shard-size", "-5GB"]]
)
def test_usage_mistakes_are_one_line(args):
    proc = cli(*args)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--help" in proc.stderr, proc.stderr
