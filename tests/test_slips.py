"""Issue #12, everyday slips: output spellings, outputs that join the source, a missing torch,
--version, rules that do nothing, long collisions, hub caches, a target model's config under
--plan eagle4, side files, a full disk behind stdout, and the docs a newcomer reads."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from eagle4_drafts import make_draft
from helpers import cli, llama_like, read_all, save, save_sharded

import streamck
from streamck import PlanError, Rule, Rules, compile_plan, open_checkpoint
from streamck.errors import TORCH_HINT  # "pip install torch …": no unpublished streamck[cast] (#54 item 2)
from streamck.plan.eagle4.layout import BIASES, COPIED_CONFIG, TENSORS

REPO = Path(streamck.__file__).resolve().parents[1]


def one_line_error(proc, needle: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert needle in proc.stderr, proc.stderr


@pytest.fixture
def src(tmp_path):
    return save(tmp_path / "src" / "model.safetensors", llama_like()).parent


# 1. `-o .` and other spellings of an existing directory.
@pytest.mark.parametrize("spelling", [".", "./", "out/"])
def test_existing_directory_spellings_are_directory_targets(tmp_path, src, spelling):
    out = tmp_path / "work" / "out"
    out.mkdir(parents=True)
    inode = out.stat().st_ino
    cwd = out if spelling.startswith(".") else out.parent
    proc = cli("rewrite", src, "-o", spelling, "-q", cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert out.stat().st_ino == inode  # filled, not swapped: a shell standing in it keeps its directory
    assert read_all(out).keys() == read_all(src).keys()


def test_dot_dot_and_the_source_directory_are_one_line_refusals(tmp_path, src):
    (tmp_path / "work" / "sub").mkdir(parents=True)
    (tmp_path / "work" / "notes.md").write_text("mine")
    proc = cli("rewrite", src, "-o", "..", cwd=tmp_path / "work" / "sub")
    one_line_error(proc, f"{tmp_path / 'work'}: already exists; pass --force to write into it")
    one_line_error(cli("rewrite", src, "-o", ".", cwd=src), "refusing to write over the source checkpoint")


# 2. An output that would join the source's shard set.
def test_output_that_would_join_the_source_shards_is_refused(tmp_path):
    src = save_sharded(tmp_path / "orig", llama_like(), 2, index=False)
    for name in ("model-bf16.safetensors", "pytorch_model-x.bin"):
        proc = cli("rewrite", src, "-o", src / name, "--dtype", "bf16", "-q")
        one_line_error(proc, "would be read as one of its shards")
        assert not (src / name).exists()
    assert cli("rewrite", src, "-o", src / "sub", "-q").returncode == 0  # a folder is never globbed
    assert len(open_checkpoint(src).tensors) == len(llama_like())


def test_an_index_keeps_an_extra_file_out_of_the_shard_set(tmp_path):
    src = save_sharded(tmp_path / "orig", llama_like(), 2)
    assert cli("rewrite", src, "-o", src / "model-f16.safetensors", "-q").returncode == 0
    assert len(open_checkpoint(src).tensors) == len(llama_like())


# 3. A cast without torch.
def without_torch(*args):
    code = f"import sys; sys.modules['torch'] = None\nfrom streamck.cli import main\nsys.exit(main({list(args)!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)


def test_cast_without_torch_names_the_extra(tmp_path, src):
    proc = without_torch("rewrite", str(src), "-o", str(tmp_path / "o"), "--dtype", "bf16", "--device", "cuda", "-q")
    one_line_error(
        proc,
        f"casting on cuda needs torch, which is not installed: {TORCH_HINT}",
    )
    assert not [p for p in tmp_path.iterdir() if p.name != "src"]
    proc = without_torch("rewrite", str(src), "-o", str(tmp_path / "p"), "--dtype", "bf16", "-q")
    if proc.returncode:  # CPU casts that still run through torch
        one_line_error(
            proc,
            f"casting needs torch, which is not installed: {TORCH_HINT}",
        )


def test_device_cuda_with_nothing_to_cast_is_an_error(tmp_path, src):
    """Issue #36: --device cuda where nothing is cast still needs the device, as the README
    says: one line, exit 2, nothing written; without torch, and with torch but no GPU (any
    GPU hidden from the child)."""
    no_gpu = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = without_torch("rewrite", str(src), "-o", str(tmp_path / "o"), "--device", "cuda", "-q")
    one_line_error(
        proc,
        f"casting on cuda needs torch, which is not installed: {TORCH_HINT}",
    )
    proc = cli("rewrite", src, "-o", tmp_path / "p", "--device", "cuda:1", "-q", env=no_gpu)
    one_line_error(proc, "--device cuda:1: no usable CUDA device")
    with open(tmp_path / "stream", "wb") as stdout:
        proc = subprocess.run(
            [sys.executable, "-m", "streamck", "rewrite", str(src), "-o", "-", "--device", "cuda", "-q"],
            stdout=stdout, stderr=subprocess.PIPE, text=True, cwd=REPO, env=no_gpu,
        )  # fmt: skip
    one_line_error(proc, "--device cuda: no usable CUDA device")
    assert (tmp_path / "stream").stat().st_size == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "stream"]


# 4. --version.
def test_version():
    proc = cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"streamck {streamck.__version__}"


# 5. Rules that do nothing, and diff's --ignore globs.
def test_rules_that_do_nothing_are_noticed(src):
    proc = cli(
        "rewrite", src, "--dry-run", "--strip-prefix", "model.", "--strip-prefix", "nope.", "--drop", "*.nothing",
        "--rename", "zzz=y", "--cast", "*.none=bf16", "--keep", "*",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    notes = [line for line in proc.stderr.splitlines() if line.startswith("streamck: note:")]
    assert notes == [
        "streamck: note: --strip-prefix 'nope.' matches nothing: no tensor name starts with it",
        "streamck: note: --drop '*.nothing' drops nothing: it matches no tensor name",
        "streamck: note: --rename 'zzz=y' renames nothing: it matches no tensor name",
        "streamck: note: --cast '*.none=bf16' casts nothing: it matches no tensor name, or a later --cast wins",
    ]
    plan = compile_plan(open_checkpoint(src), Rules((Rule("drop", "*.inv_freq"), Rule("add_prefix", "x."))))
    assert plan.notices == []


def test_diff_ignore_globs_are_checked(src):
    one_line_error(cli("diff", src, src, "--ignore", "model.[layers"), "--ignore: invalid glob 'model.[layers'")
    with pytest.raises(streamck.UsageError, match="reversed range"):
        streamck.diff(src, src, ignore=["layers.[9-0]"])


# 6. A collision error stays short.
def test_a_mass_collision_is_a_short_message(tmp_path):
    ckpt = open_checkpoint(save(tmp_path / "m.safetensors", {f"t{i}": np.zeros(1) for i in range(400)}))
    with pytest.raises(PlanError) as e:
        compile_plan(ckpt, Rules((Rule("rename", "^.*$=w"),)))
    assert str(e.value) == "1 output names collide: t0, t1 (+398 more) -> w"
    ckpt = open_checkpoint(save(tmp_path / "n.safetensors", {f"{p}.{i}": np.zeros(1) for p in "ab" for i in range(99)}))
    with pytest.raises(PlanError) as e:
        compile_plan(ckpt, Rules((Rule("rename", "^[ab]=c"),)))
    assert str(e.value).startswith("99 output names collide: a.0, b.0 -> c.0, ") and len(str(e.value)) < 200


# 7. Hugging Face cache entries and repo ids, offline.
def hub_entry(cache: Path, repo: str, commit: str = "a" * 40) -> Path:
    entry = cache / ("models--" + repo.replace("/", "--"))
    snap = entry / "snapshots" / commit
    save(entry / "blobs" / "w1", {"w": np.arange(3, dtype=np.float32)})
    snap.mkdir(parents=True)
    (snap / "model.safetensors").symlink_to("../../blobs/w1")
    (snap / "config.json").write_text('{"model_type": "llama"}')
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(commit)
    (entry / "snapshots" / ("b" * 40)).mkdir()  # an older snapshot: refs/main decides
    return entry


def test_hub_cache_entry_and_repo_id(tmp_path):
    entry = hub_entry(tmp_path / "hub", "org/name")
    assert f"under {entry / 'snapshots' / ('a' * 40)}," in cli("ls", entry).stdout
    env = {"HF_HUB_CACHE": str(tmp_path / "hub")}
    proc = cli("rewrite", "org/name", "-o", tmp_path / "out", "-q", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]
    home = {"HF_HUB_CACHE": "", "HF_HOME": str(tmp_path)}  # HF_HOME/hub
    assert cli("ls", "org/name", "--json", cwd=tmp_path, env=home).returncode == 0
    one_line_error(cli("ls", "org/other", cwd=tmp_path, env=env), "nor a repo in the Hugging Face cache")
    (entry / "refs" / "main").write_text("c" * 40)
    one_line_error(cli("ls", entry), "refs/main names snapshot 'cccc")


# 8. --plan eagle4 on a target model's config.
def test_eagle4_on_a_plain_llama_config(tmp_path):
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8, "vocab_size": 16}
    save(tmp_path / "llama" / "model.safetensors", llama_like())
    (tmp_path / "llama" / "config.json").write_text(json.dumps(config))
    proc = cli("rewrite", tmp_path / "llama", "--plan", "eagle4", "-o", tmp_path / "out")
    one_line_error(proc, "is not an EAGLE draft's config (LlamaForCausalLM, no eagle_config or efficient_lm_head keys)")
    src, _, _ = make_draft(tmp_path / "step")  # a real draft still exports
    assert cli("rewrite", src, "--plan", "eagle4", "-o", tmp_path / "draft", "-q").returncode == 0


# 9. Side files: everything a loader may need, nothing of training.
SIDE = [
    "README.md", "added_tokens.json", "chat_template.jinja", "config.json", "configuration_custom.py",
    "config_sentence_transformers.json", "generation_config.json", "merges.txt", "modeling_custom.py", "modules.json",
    "special_tokens_map.json", "spiece.model", "tokenizer.json", "tokenizer_config.json", "vocab.txt",
]  # fmt: skip
TRAINING = [
    "optimizer.pt", "scheduler.pt", "rng_state_0.pth", "trainer_state.json", "training_args.bin", "zero_to_fp32.py",
    "zero_to_torch.py", "__0_0.distcp", "tf_model.h5", ".gitattributes",
]  # fmt: skip


def test_side_files_are_everything_but_weights_and_training_state(tmp_path):
    from streamck.source.layout import side_files

    src = save_sharded(tmp_path / "src", llama_like(), 2)
    for name in SIDE + TRAINING:
        (src / name).write_text("x")
    (src / "modules.json").write_text(json.dumps([{"path": ""}, {"path": "1_Pooling"}, {"path": "../escape"}]))
    (src / "1_Pooling").mkdir()
    (src / "1_Pooling" / "config.json").write_text("{}")
    for folder in ("global_step5", "checkpoint-5", "runs"):
        (src / folder).mkdir()
        (src / folder / "x.json").write_text("{}")
    dry = cli("rewrite", src, "-o", tmp_path / "out", "--dry-run")
    assert f"copied into a directory output: {', '.join(sorted(SIDE))}, 1_Pooling/" in dry.stdout
    for _ in range(2):  # the second time over the first export, with --force
        proc = cli("rewrite", src, "-o", tmp_path / "out", "--force", "-q")
        assert proc.returncode == 0, proc.stderr
        assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted([*SIDE, "1_Pooling", "model.safetensors"])
        assert (tmp_path / "out" / "1_Pooling" / "config.json").read_text() == "{}"
    for name in ("latest", "LATEST.txt", "fqn_to_file_index_mapping.json"):  # run bookkeeping: a source of its own
        (tmp_path / "run" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "run" / name).write_text("x")
    assert side_files(tmp_path / "run") == {}


# 10. A full disk behind stdout.
def test_disk_full_on_stdout_names_stdout(src):
    with open("/dev/full", "wb") as full:
        proc = subprocess.run(
            [sys.executable, "-m", "streamck", "rewrite", str(src), "-o", "-", "-q"],
            stdout=full, stderr=subprocess.PIPE, text=True, cwd=REPO,
        )  # fmt: skip
    one_line_error(proc, "streamck: error: stdout: write failed: No space left on device")


# 11. The EAGLE-4 layout documented in the repository; the example's expected refusal.
def test_eagle4_layout_is_documented_in_the_repository():
    readme = (REPO / "README.md").read_text()
    doc = (REPO / "docs" / "eagle4.md").read_text()
    assert "../shared" not in readme and "docs/eagle4.md" in readme
    rows = [*TENSORS, *(row for extra in BIASES.values() for row in extra)]
    for row in rows:
        assert f"`{row.out}`" in doc and f"`{row.src}`" in doc, row
    assert all(key in doc for key in COPIED_CONFIG)


def test_example_says_its_last_refusal_is_expected():
    lines = (REPO / "scripts" / "example").read_text().strip().splitlines()
    refusal = next(line for line in lines if "broken.safetensors" in line and "streamck ls" in line)
    assert "expected" in refusal and lines[-1].startswith('echo "demo done')
