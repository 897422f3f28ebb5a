"""Key-set checks for CI: manifests, diff, hash, rewrite --verify."""

import json
import subprocess
import sys

import numpy as np
import pytest
from helpers import cli, llama_like, save, save_sharded

from streamck import OutputError, Rules, compile_plan, open_checkpoint, write_plan
from streamck.check import collapse, diff


def test_collapse_layer_patterns():
    names = [f"model.layers.{i}.mlp.up_proj.weight" for i in range(80)] + ["lm_head.weight"]
    assert collapse(names) == ["lm_head.weight", "model.layers.{0..79}.mlp.up_proj.weight"]
    assert collapse(["a.1.x", "a.2.x", "a.4.x"]) == ["a.{1..2,4}.x"]
    experts = [f"layers.{layer}.experts.{e}.w" for layer in range(4) for e in range(8)]
    assert collapse(experts) == ["layers.{0..3}.experts.{0..7}.w"]
    assert collapse(["x.0.a", "x.1.b"]) == ["x.0.a", "x.1.b"]


def test_every_kind_of_difference(tmp_path):
    a = {f"model.layers.{i}.w": np.zeros(4, np.float32) for i in range(6)}
    a |= {
        "keep": np.zeros(2, np.float32),
        "dt": np.zeros(2, np.float32),
        "sh": np.zeros(4, np.float32),
        "gone": np.zeros(1, np.int8),
    }
    b = {f"layers.{i}.w": np.zeros(4, np.float32) for i in range(6)}
    b |= {
        "keep": np.zeros(2, np.float32),
        "dt": np.zeros(2, np.float16),
        "sh": np.zeros((2, 2), np.float32),
        "new": np.zeros(1, np.int8),
    }
    result = diff(save(tmp_path / "a.safetensors", a), save(tmp_path / "b.safetensors", b))
    assert result.only_a == sorted(["gone", *(f"model.layers.{i}.w" for i in range(6))])
    assert result.only_b == sorted(["new", *(f"layers.{i}.w" for i in range(6))])
    assert result.dtype == [("dt", "F32", "F16")]
    assert result.shape == [("sh", [4], [2, 2])]
    text = str(result)
    assert "  - model.layers.{0..5}.w" in text and "  + layers.{0..5}.w" in text
    assert "  ~ dt: F32 -> F16" in text and "  ~ sh: [4] -> [2, 2]" in text
    assert not result.equal and result


def test_equal_and_exit_codes(tmp_path):
    ck = save_sharded(tmp_path / "ck", llama_like(), 2)
    (tmp_path / "golden.json").write_text(cli("ls", ck, "--json").stdout)
    same = cli("diff", tmp_path / "golden.json", ck)
    assert same.returncode == 0 and "same 13 tensors: names, dtypes, shapes; values not compared" in same.stdout
    other = save(tmp_path / "o.safetensors", {"x": np.zeros(1)})
    assert cli("diff", tmp_path / "golden.json", other).returncode == 1
    bad = cli("diff", tmp_path / "golden.json", tmp_path / "missing")
    assert bad.returncode == 2 and bad.stderr.startswith("streamck: error:")


def test_equal_says_what_was_compared(tmp_path):
    """Issue #36: without --data, values are not compared, and the report says so rather
    than "no differences"; with --data or digests, it says they were."""
    tensors = llama_like()
    a = save(tmp_path / "a.safetensors", tensors)
    b = save(tmp_path / "b.safetensors", {k: v + 1 if v.dtype.kind == "f" else v for k, v in tensors.items()})
    headers = cli("diff", a, b, check=0).stdout
    assert headers.splitlines()[-1] == (
        "same 13 tensors: names, dtypes, shapes; values not compared (--data compares them)"
    )
    assert "no differences" not in headers
    assert json.loads(cli("diff", a, b, "--json", check=0).stdout)["compared"] == ["names", "dtypes", "shapes"]
    assert "data changed (" in cli("diff", a, b, "--data", check=1).stdout
    same = cli("diff", a, a, "--data", check=0).stdout
    assert same.splitlines()[-1] == "same 13 tensors: names, dtypes, shapes and values"
    (tmp_path / "a.json").write_text(cli("hash", a, "--json", check=0).stdout)
    hashed = cli("diff", tmp_path / "a.json", a, check=0).stdout
    assert hashed.splitlines()[-1] == "same 13 tensors: names, dtypes, shapes, sha256 and whole files"  # #43: files too


def test_manifest_against_dry_run_manifest(tmp_path):
    ck = save_sharded(tmp_path / "ck", llama_like(), 2)
    dry = cli("rewrite", ck, "--dry-run", "--json", "--strip-prefix", "model.", "--drop", "*inv_freq").stdout
    (tmp_path / "now.json").write_text(dry)
    proc = cli("diff", ck, tmp_path / "now.json", "--json")
    report = json.loads(proc.stdout)
    assert proc.returncode == 1
    assert "model.layers.0.self_attn.rotary_emb.inv_freq" in report["only_a"]
    assert "layers.0.mlp.up_proj.weight" in report["only_b"]


def test_ignore(tmp_path):
    a = save(tmp_path / "a.safetensors", {"w": np.zeros(2), "x.inv_freq": np.zeros(1)})
    b = save(tmp_path / "b.safetensors", {"w": np.zeros(2)})
    assert not diff(a, b, ignore=("*.inv_freq",))
    assert cli("diff", a, b, "--ignore", "*.inv_freq").returncode == 0


def test_api_str_is_the_cli_report(tmp_path):
    a = save(tmp_path / "a.safetensors", {"w": np.zeros(2)})
    b = save(tmp_path / "b.safetensors", {"w": np.zeros(3)})
    assert cli("diff", a, b).stdout == str(diff(a, b)) + "\n"


def test_data_finds_a_one_element_change(tmp_path):
    t = llama_like()
    a = save(tmp_path / "a.safetensors", t)
    t2 = {k: v.copy() for k, v in t.items()}
    t2["model.layers.1.mlp.up_proj.weight"][3, 5] += 0.25
    b = save_sharded(tmp_path / "b", t2, 3)
    assert diff(a, b).equal  # headers agree
    result = diff(a, b, data=True)
    (d,) = result.data
    assert d.name == "model.layers.1.mlp.up_proj.weight" and d.differing == 1 and d.numel == 128
    assert d.max_abs == pytest.approx(0.25, abs=1e-6)
    proc = cli("diff", a, b, "--data")
    assert proc.returncode == 1 and "1 of 128 elements differ, max |a-b| = 0.25" in proc.stdout


def test_data_needs_checkpoints(tmp_path):
    a = save(tmp_path / "a.safetensors", {"w": np.zeros(2)})
    (tmp_path / "m.json").write_text(cli("ls", a, "--json").stdout)
    proc = cli("diff", a, tmp_path / "m.json", "--data")
    assert proc.returncode == 2 and "both sides must be checkpoints" in proc.stderr


def test_hash_manifest_and_digest_diff(tmp_path):
    t = llama_like()
    a = save(tmp_path / "a.safetensors", t)
    proc = cli("hash", a, "--json", "-o", tmp_path / "a.sha.json")
    assert proc.returncode == 0
    hashes = json.loads((tmp_path / "a.sha.json").read_text())
    import hashlib

    assert hashes["tensors"]["lm_head.weight"]["sha256"] == hashlib.sha256(t["lm_head.weight"].tobytes()).hexdigest()
    assert cli("diff", tmp_path / "a.sha.json", a).returncode == 0
    t["lm_head.weight"][0, 0] = 9
    b = save(tmp_path / "b.safetensors", t)
    proc = cli("diff", tmp_path / "a.sha.json", b)
    assert proc.returncode == 1 and "digest changed (1):" in proc.stdout and "! lm_head.weight" in proc.stdout
    plain = cli("hash", a).stdout.splitlines()
    assert len(plain) == len(t) and plain[0].endswith("  lm_head.weight")


def test_ls_and_diff_never_import_torch(tmp_path):
    a = save_sharded(tmp_path / "a", llama_like(), 2)
    code = (
        "import sys; from streamck.cli import main\n"
        f"main(['ls', {str(a)!r}, '--json']); main(['diff', {str(a)!r}, {str(a)!r}, '--data'])\n"
        f"main(['hash', {str(a)!r}])\n"
        "assert 'torch' not in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("dtype", [None, "bf16"])
def test_verify_catches_a_byte_flipped_before_verification(tmp_path, monkeypatch, dtype):
    import streamck.writer.destination as rw  # where the write meets its target (#49)

    src = save(tmp_path / "s.safetensors", llama_like())
    real = rw.verify_shard

    def tamper(shard, path, *rest):
        with open(path, "r+b") as f:
            f.seek(-3, 2)
            byte = f.read(1)
            f.seek(-3, 2)
            f.write(bytes([byte[0] ^ 0x40]))
        real(shard, path, *rest)

    monkeypatch.setattr(rw, "verify_shard", tamper)
    plan = compile_plan(open_checkpoint(src), Rules(dtype=dtype))
    with pytest.raises(OutputError, match="verification failed"):
        write_plan(plan, tmp_path / "o.safetensors", verify=True)
    assert not (tmp_path / "o.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.safetensors"]


@pytest.mark.parametrize("dtype", [None, "fp16"])
def test_cli_verify_checks_every_shard(tmp_path, monkeypatch, capsys, dtype):
    import streamck.writer.destination as rw  # where the write meets its target (#49)
    from streamck.cli import main

    checked = []
    real = rw.verify_shard

    def counting(shard, path, *rest):
        checked.append(path.name)
        real(shard, path, *rest)

    monkeypatch.setattr(rw, "verify_shard", counting)
    src = save_sharded(tmp_path / "s", llama_like(), 2)
    args = ["--dtype", dtype] if dtype else []
    assert (
        main(["rewrite", str(src), "-o", str(tmp_path / "o"), "--verify", "--max-shard-size", "1KB", "-q", *args]) == 0
    )
    shards = sorted(p.name for p in (tmp_path / "o").glob("*.safetensors"))
    assert len(shards) > 1 and sorted(checked) == shards
    assert main(["rewrite", str(src), "-o", str(tmp_path / "p"), "-q"]) == 0
    assert len(checked) == len(shards)  # and nothing without --verify


def test_cli_verify_failure_leaves_nothing(tmp_path, monkeypatch, capsys):
    import streamck.writer.destination as rw  # where the write meets its target (#49)
    from streamck.cli import main

    def tampered(shard, path, *rest):
        with open(path, "r+b") as f:
            f.seek(-1, 2)
            f.write(b"\xff" if f.read(0) == b"" else b"")
        rw_real(shard, path, *rest)

    rw_real = rw.verify_shard
    monkeypatch.setattr(rw, "verify_shard", tampered)
    src = save(tmp_path / "s.safetensors", {"w": np.zeros(16, np.float32)})
    assert main(["rewrite", str(src), "-o", str(tmp_path / "o.safetensors"), "--verify"]) == 2
    err = capsys.readouterr().err
    assert "verification failed: w differs from its source" in err and err.count("\n") == 1
    assert not (tmp_path / "o.safetensors").exists()


def test_malformed_manifest_is_a_clear_error(tmp_path):
    (tmp_path / "m.json").write_text('{"tensors": {"w": {"shape": [2]}}}')
    a = save(tmp_path / "a.safetensors", {"w": np.zeros(2)})
    proc = cli("diff", tmp_path / "m.json", a)
    assert proc.returncode == 2 and "tensor 'w' has no string dtype" in proc.stderr and "Traceback" not in proc.stderr
    (tmp_path / "x.json").write_text('{"nope": 1}')
    proc = cli("diff", tmp_path / "x.json", a)
    assert proc.returncode == 2 and "not a manifest" in proc.stderr
