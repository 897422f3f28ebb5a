"""PyTorch .bin/.pt sources, Trainer run roots and streaming to stdout."""

import io
import json
import os
import pickle
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import torch
from helpers import cli, save
from safetensors.torch import load, load_file

from streamck import CheckpointError, Rules, compile_plan, open_checkpoint, write_plan
from streamck.check import diff


def tricky_state_dict():
    torch.manual_seed(0)
    base = torch.randn(6, 10)
    shared = torch.arange(40, dtype=torch.float32)
    emb = torch.randn(12, 4)
    return {
        "plain": torch.randn(3, 5),
        "transposed": base.t(),  # non-contiguous, saved as is
        "column": base[:, 3],  # strided view
        "slice": shared[5:25].view(4, 5),  # view at an offset into a shared storage
        "other_slice": shared[30:],  # same storage, another part
        "embed.weight": emb,
        "lm_head.weight": emb,  # tied: two names, one storage
        "half": torch.randn(7).half(),
        "bf16": torch.randn(2, 3).bfloat16(),
        "long": torch.arange(5),
        "mask": torch.tensor([True, False, True]),
        "bytes": torch.arange(9, dtype=torch.uint8).view(3, 3).t(),
        "fp8": torch.randn(4).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 3),
        "param": torch.nn.Parameter(torch.ones(2, 2)),
    }


def assert_matches_torch_load(out_file, src_file, rename=lambda n: n):
    expected = torch.load(src_file, weights_only=True)
    got = load_file(out_file)
    assert sorted(got) == sorted(rename(n) for n in expected)
    for name, t in expected.items():
        g = got[rename(name)]
        assert g.dtype == t.dtype and g.shape == t.shape, name
        assert torch.equal(
            g.view(torch.uint8) if g.dtype == torch.float8_e4m3fn else g,
            t.contiguous().view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t,
        ), name


def test_bin_with_views_shared_and_tied_storages(tmp_path):
    torch.save(tricky_state_dict(), tmp_path / "pytorch_model.bin")
    assert not tricky_state_dict()["transposed"].is_contiguous()
    ckpt = open_checkpoint(tmp_path / "pytorch_model.bin")
    assert ckpt.tensors["transposed"].strides is not None and ckpt.tensors["plain"].strides is None
    write_plan(compile_plan(ckpt), tmp_path / "out.safetensors")
    assert_matches_torch_load(tmp_path / "out.safetensors", tmp_path / "pytorch_model.bin")


def test_module_state_dict_and_small_chunks(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8))
    sd = model.state_dict()
    sd["t"] = torch.randn(50, 40).t()
    torch.save(sd, tmp_path / "m.pt")
    write_plan(compile_plan(open_checkpoint(tmp_path / "m.pt")), tmp_path / "o.safetensors", chunk=100)
    assert_matches_torch_load(tmp_path / "o.safetensors", tmp_path / "m.pt")


def test_read_api_gives_row_major_bytes(tmp_path):
    torch.save(tricky_state_dict(), tmp_path / "w.bin")
    ckpt = open_checkpoint(tmp_path / "w.bin")
    t = tricky_state_dict()["transposed"]
    assert bytes(ckpt.read("transposed")) == t.contiguous().numpy().tobytes()


def test_sharded_bin_with_index(tmp_path):
    sd = tricky_state_dict()
    names = sorted(sd)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2]), 1):
        shard = f"pytorch_model-0000{i}-of-00002.bin"
        torch.save({n: sd[n] for n in part}, tmp_path / shard)
        weight_map |= dict.fromkeys(part, shard)
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    proc = cli("rewrite", tmp_path, "-o", tmp_path / "out", "--strip-prefix", "x")
    assert proc.returncode == 0, proc.stderr
    got = load_file(tmp_path / "out" / "model.safetensors")
    for n, t in sd.items():
        if t.dtype != torch.float8_e4m3fn:
            assert torch.equal(got[n], t)
    del weight_map[names[0]]
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="missing from weight_map"):
        open_checkpoint(tmp_path)


def test_cast_from_bin(tmp_path):
    torch.save({"w": torch.randn(33, 7), "i": torch.arange(3)}, tmp_path / "a.bin")
    write_plan(compile_plan(open_checkpoint(tmp_path / "a.bin"), Rules(dtype="bf16")), tmp_path / "o.safetensors")
    got = load_file(tmp_path / "o.safetensors")
    src = torch.load(tmp_path / "a.bin", weights_only=True)
    assert torch.equal(got["w"], src["w"].to(torch.bfloat16)) and torch.equal(got["i"], src["i"])


@pytest.mark.parametrize(("dtype", "chunk"), [("bf16", 24), ("fp64", 40), ("fp16", 1 << 20)])
def test_cast_of_non_contiguous_views(tmp_path, dtype, chunk):
    # Gathered in row-major blocks, then cast block by block; tiny chunks make many blocks
    # (F64 doubles every block on the way out).
    torch.save(tricky_state_dict(), tmp_path / "a.bin")
    plan = compile_plan(open_checkpoint(tmp_path / "a.bin"), Rules(dtype=dtype))
    write_plan(plan, tmp_path / "o.safetensors", chunk=chunk, verify=True)
    got = load_file(tmp_path / "o.safetensors")
    want = {"bf16": torch.bfloat16, "fp64": torch.float64, "fp16": torch.float16}[dtype]
    for name, t in tricky_state_dict().items():
        castable = t.dtype in (torch.float32, torch.float16, torch.bfloat16)
        assert torch.equal(got[name], t.to(want) if castable else t.contiguous()), name


def test_verify_of_a_large_view_whose_blocks_are_not_read_chunks(tmp_path):
    # 20 MB, rows of 4000 bytes: gathered blocks never line up with 16 MiB read chunks.
    torch.save({"t": torch.randn(1000, 5003).t()}, tmp_path / "a.bin")
    for args in ([], ["--dtype", "bf16"]):
        proc = cli("rewrite", tmp_path / "a.bin", "-o", tmp_path / f"o{len(args)}.safetensors", "--verify", *args)
        assert proc.returncode == 0, proc.stderr


class Evil:
    def __reduce__(self):
        return (os.system, (f"touch {Evil.marker}",))


def test_malicious_pickle_is_refused_and_runs_nothing(tmp_path):
    Evil.marker = tmp_path / "pwned"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps({"w": Evil()}, protocol=2))
        z.writestr("archive/byteorder", "little")
    (tmp_path / "evil.bin").write_bytes(buf.getvalue())
    proc = cli("ls", tmp_path / "evil.bin")
    assert proc.returncode == 2 and "refusing to load posix.system" in proc.stderr
    assert proc.stderr.count("\n") == 1
    assert not Evil.marker.exists()


def test_legacy_format_refused_with_advice(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "old.bin", _use_new_zipfile_serialization=False)
    proc = cli("ls", tmp_path / "old.bin")
    assert proc.returncode == 2 and "legacy torch file" in proc.stderr and "weights_only=True" in proc.stderr


def test_compressed_storage_refused(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "a.bin")
    with zipfile.ZipFile(tmp_path / "a.bin") as src, zipfile.ZipFile(tmp_path / "z.bin", "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info), compress_type=zipfile.ZIP_DEFLATED)
    with pytest.raises(CheckpointError, match="compressed"):
        open_checkpoint(tmp_path / "z.bin")


def make_run(root):
    for step in (900, 1000, 50):
        d = root / f"checkpoint-{step}"
        d.mkdir(parents=True)
        torch.save({"model.w": torch.full((2,), float(step))}, d / "pytorch_model.bin")
        (d / "optimizer.pt").write_bytes(b"not even a zip")  # never read as weights
        (d / "training_args.bin").write_bytes(b"junk")
        (d / "trainer_state.json").write_text("{}")
        (d / "config.json").write_text(json.dumps({"step": step}))
        (d / "tokenizer.json").write_text("{}")
    return root


def test_run_root_needs_a_step(tmp_path):
    proc = cli("ls", make_run(tmp_path / "run"))
    assert proc.returncode == 2 and "steps 50, 900, 1000" in proc.stderr and "--step" in proc.stderr


def test_step_latest_is_numeric_and_side_files_are_copied(tmp_path):
    run = make_run(tmp_path / "run")
    proc = cli("rewrite", run, "--step", "latest", "-o", tmp_path / "deploy", "--strip-prefix", "model.", "-q")
    assert proc.returncode == 0, proc.stderr
    deploy = tmp_path / "deploy"
    assert sorted(p.name for p in deploy.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert json.loads((deploy / "config.json").read_text()) == {"step": 1000}
    assert torch.equal(load_file(deploy / "model.safetensors")["w"], torch.full((2,), 1000.0))
    proc = cli("rewrite", run, "--step", "900", "-o", tmp_path / "d2", "--no-copy-files", "-q")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "d2").iterdir()) == ["model.safetensors"]
    assert "checkpoint-900" in cli("ls", run, "--step", "900").stdout
    bad = cli("ls", run, "--step", "7")
    assert bad.returncode == 2 and "no step 7 here (steps: 50, 900, 1000)" in bad.stderr


def test_stdout_stream_is_a_valid_sequential_file(tmp_path):
    sd = tricky_state_dict()
    torch.save(sd, tmp_path / "m.bin")
    piped = subprocess.run(
        f"{sys.executable} -m streamck rewrite {tmp_path / 'm.bin'} -o - --strip-prefix x | cat",
        shell=True,
        capture_output=True,
    )
    assert piped.returncode == 0, piped.stderr
    write_plan(compile_plan(open_checkpoint(tmp_path / "m.bin")), tmp_path / "file.safetensors")
    assert piped.stdout == (tmp_path / "file.safetensors").read_bytes()
    got = load(piped.stdout)
    assert torch.equal(got["transposed"], sd["transposed"])


def test_stdout_refuses_a_terminal_and_shards(tmp_path):
    src = save(tmp_path / "s.safetensors", {"a": np.ones(2)})
    proc = cli("rewrite", src, "-o", "-", "--max-shard-size", "1KB")
    assert proc.returncode == 2 and "--max-shard-size" in proc.stderr


def test_ls_and_diff_on_bin(tmp_path):
    torch.save(tricky_state_dict(), tmp_path / "a.bin")
    manifest = json.loads(cli("ls", tmp_path / "a.bin", "--json").stdout)
    assert manifest["tensors"]["transposed"] == {"dtype": "F32", "shape": [10, 6]}
    write_plan(compile_plan(open_checkpoint(tmp_path / "a.bin")), tmp_path / "b.safetensors")
    assert diff(tmp_path / "a.bin", tmp_path / "b.safetensors", data=True).equal


def test_stdout_closed_early(tmp_path):
    torch.save({"w": torch.randn(512, 512)}, tmp_path / "m.bin")
    cmd = f"{sys.executable} -m streamck rewrite {tmp_path / 'm.bin'} -o - | head -c 100 > /dev/null"
    proc = subprocess.run(["bash", "-c", f"set -o pipefail; {cmd}"], capture_output=True, text=True)
    assert proc.returncode == 2 and "stdout closed before the whole checkpoint" in proc.stderr
    assert "Traceback" not in proc.stderr
    listing = subprocess.run(
        [
            "bash",
            "-c",
            f"set -o pipefail; {sys.executable} -m streamck ls {tmp_path / 'm.bin'} --json | head -c 10 > /dev/null",
        ],
        capture_output=True,
        text=True,
    )
    assert listing.returncode == 0 and listing.stderr == ""


def test_diff_data_of_a_transposed_view_against_its_contiguous_copy(tmp_path):
    # The view is gathered in blocks, the copy read in chunks: windows must not follow either.
    t = torch.randn(1100, 4096)
    torch.save({"w": t.t()}, tmp_path / "a.bin")
    torch.save({"w": t.t().contiguous()}, tmp_path / "b.bin")
    assert diff(tmp_path / "a.bin", tmp_path / "b.bin", data=True).equal
    changed = t.t().contiguous()
    changed[4000, 1000] += 1
    torch.save({"w": changed}, tmp_path / "c.bin")
    result = diff(tmp_path / "a.bin", tmp_path / "c.bin", data=True)
    assert [(d.name, d.differing) for d in result.data] == [("w", 1)]
