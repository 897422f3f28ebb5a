"""A second reading of a trainer's step straight to GGUF / MLX (#50, #51: writer/formats/sidecar.py)
and of gpt-oss to MLX (#51: writer/formats/mlx/gptoss.py), on the inputs their own tests
(tests/test_plan_to_gguf.py, tests/test_mlx_gptoss.py) leave out:

- gpt-oss saved by ``dcp.save`` (what FSDP2 writes), the published MXFP4 layout and transformers'
  bf16 one: the folder mlx_lm.convert writes of the Hugging Face folder, as from that folder; a
  stack cut into blocks (expert parallel) read as the same stack whole;
- a tokenizer beside the step that links out of it: not followed, and the line says so, naming
  the folders it looked in (not a temporary one);
- a step and the model's folder in a bucket: the file the local command writes, and no
  temporary folder left behind.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
from helpers import cli

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Path:
    """The tiny GGUF Qwen3 (tests/gguf_models.py), its folder named ``model``."""
    from gguf_models import tiny_model

    return tiny_model(tmp_path_factory, "qwen3")


@pytest.fixture(scope="module")
def step(qwen3, tmp_path_factory) -> Path:
    """The tiny Qwen3 as a torchtitan step (tests/test_plan_to_gguf.py's), saved once for the module."""
    from test_plan_to_gguf import titan_step

    return titan_step(qwen3, tmp_path_factory.mktemp("titan") / "checkpoint" / "step-10")


def _one_line(proc, out: Path) -> str:
    """The one error line of a refused rewrite; asserts no traceback and nothing at ``out``."""
    errors = [line for line in proc.stderr.splitlines() if line.startswith("streamck: error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert not out.exists() and not list(out.parent.glob(f".{out.name}*")), list(out.parent.iterdir())
    return errors[0]


def test_a_tokenizer_linked_out_of_the_run_is_not_followed(qwen3, step, tmp_path):
    """A config alone given, the tokenizer beside the step a link to a folder outside the run: the
    link is not followed (as for any side file), and the line names the folders looked in and the
    link, not the temporary folder a model folder would have been made in."""
    run = tmp_path / "run"
    shutil.copytree(step, run / "step-10")
    outside = tmp_path / "outside"
    outside.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(qwen3 / name, outside / name)
        (run / name).symlink_to(outside / name)
    config = tmp_path / "config-only" / "config.json"
    config.parent.mkdir()
    shutil.copy(qwen3 / "config.json", config)
    out = tmp_path / "out.gguf"
    proc = cli("rewrite", run / "step-10", "-o", out, "--plan", "torchtitan", "--hf-config", config)
    line = _one_line(proc, out)
    assert "needs the model's tokenizer" in line and str(config.parent) in line and str(run) in line, line
    assert f"{run / 'tokenizer.json'} links out of its folder" in line and "streamck-model-" not in line, line
    shutil.copy(outside / "tokenizer.json", run / "tokenizer.json.real")  # the teeth: a real file is taken
    (run / "tokenizer.json").unlink()
    (run / "tokenizer.json.real").rename(run / "tokenizer.json")
    cli("rewrite", run / "step-10", "-o", out, "--plan", "torchtitan", "--hf-config", config, check=0)


def test_a_step_in_a_bucket_is_the_local_commands_file(qwen3, step, tmp_path, server, bucket):
    """The step and the model's Hugging Face folder (``--hf-config``) in a bucket: the GGUF the
    same command writes from the local folders, byte for byte; the temporary model folder gone
    when the command ends."""
    from s3_server import s3

    fs = server.fs()
    fs.put(f"{step}/", f"{bucket}/checkpoint/step-10/", recursive=True)
    fs.put(f"{qwen3}/", f"{bucket}/model/", recursive=True)
    local, remote, tmp = tmp_path / "local.gguf", tmp_path / "remote.gguf", tmp_path / "tmp"
    tmp.mkdir()
    cli("rewrite", step, "-o", local, "--plan", "torchtitan", "--hf-config", qwen3, check=0)
    args = ("rewrite", f"s3://{bucket}/checkpoint/step-10", "-o", remote, "--plan", "torchtitan")
    s3(server, *args, "--hf-config", f"s3://{bucket}/model", env={"TMPDIR": str(tmp)}, check=0)
    assert remote.read_bytes() == local.read_bytes()
    assert list(tmp.iterdir()) == []


@pytest.fixture(scope="module")
def gptoss(tmp_path_factory) -> Path:
    """tests/mlx_gptoss_models.py's sources and mlx_lm.convert's folders of them."""
    from mlx_gptoss_models import gptoss_world

    return gptoss_world(tmp_path_factory)


def _dcp_step(src: Path, step: Path) -> Path:
    """``src``'s tensors saved by ``dcp.save`` in this process into ``step``, its config and
    tokenizer beside (the step's own folder, where an FSDP2 trainer's are)."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(src.glob("*.safetensors")):
        tensors |= load_file(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(tensors, checkpoint_id=step)
    for path in src.glob("*.json"):
        if not path.name.endswith(".index.json"):
            shutil.copy(path, step / path.name)
    return step


def test_gpt_oss_saved_by_dcp_is_mlx_lm_converts(gptoss, tmp_path):
    """The published MXFP4 layout and transformers' bf16 one, each saved by dcp.save: the folder
    is mlx_lm.convert's of the Hugging Face folder (its MXFP4 experts kept packed: down_proj_blocks
    read through the DCP file's block, not as if the tensor lay alone in a file)."""
    from mlx_env import run_jobs, write_mlx

    jobs = []
    for src in ("mxfp4", "bf16"):
        out = tmp_path / f"{src}-mlx"
        write_mlx(_dcp_step(gptoss / src, tmp_path / src / "step-1"), out)
        jobs.append({"op": "compare", "a": str(out), "b": str(gptoss / "refs" / src)})
    for answer in run_jobs(jobs):
        assert "error" not in answer and answer["count"] > 0, answer
        assert answer["only_a"] == answer["only_b"] == answer["differ"] == [] and answer["config_equal"], answer


@pytest.mark.parametrize("proj", ["down_proj", "gate_up_proj"])
def test_mxfp4_experts_cut_into_blocks_read_as_the_stack_whole(tmp_path, proj):
    """An MXFP4 ``*_blocks`` stack stored in blocks (cut between experts, as expert parallelism
    saves it, and between groups): each output tensor's bytes are those of the same stack lying
    whole in a file (what tests/test_mlx_gptoss.py checks against mlx_lm.convert)."""
    import numpy as np
    from test_titan_select import _plain, _tiled

    from streamck.plan import OutputTensor
    from streamck.source.reader import Reader
    from streamck.writer.formats.mlx import gptoss

    stack = np.random.default_rng(0).integers(0, 256, (3, 6, 2, 16), dtype=np.uint8)
    name = f"model.layers.0.mlp.experts.{proj}_blocks"
    whole = _plain(tmp_path, stack)._replace(dtype="U8", name=name)
    cut = _tiled(tmp_path, stack, [[1], [], [1], []])._replace(dtype="U8", name=name)
    outs = [gptoss._split(OutputTensor(name, ref, "U8"), "model.layers.0.mlp.experts", proj, "_blocks")
            for ref in (whole, cut)]  # fmt: skip
    with Reader() as reader:
        for want, got in zip(*outs, strict=True):
            assert (got.name, got.dtype, got.shape) == (want.name, want.dtype, want.shape)
            assert _bytes(reader, got) == _bytes(reader, want), got.name


def _bytes(reader, t) -> bytes:
    """What the writer writes of ``t``: its source's bytes, or its transform's pieces."""
    if t.transform is None:
        return reader.read(t.source)
    return b"".join(bytes(p) for p in t.transform.pieces(t, reader, {}))


def test_mlx_output_copies_no_file_that_links_out_of_the_source(tmp_path_factory, tmp_path):
    """A Hugging Face folder whose special_tokens_map.json and a ``*.py`` link to a file outside
    it (a secret): MLX output copies neither, as the note says and as ``-o DIR`` does; the
    tokenizer's real files are copied."""
    from mlx_env import write_mlx
    from mlx_models import model_folder

    src = tmp_path / "src"
    shutil.copytree(model_folder(tmp_path_factory, "llama"), src)
    secret = tmp_path / "secret"
    secret.write_text("AWS_SECRET_ACCESS_KEY=hunter2\n")
    for name in ("special_tokens_map.json", "modeling_evil.py"):
        (src / name).symlink_to(secret)
    out = tmp_path / "mlx"
    write_mlx(src, out)
    assert not (out / "special_tokens_map.json").exists() and not (out / "modeling_evil.py").exists()
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    assert all("hunter2" not in p.read_text(errors="replace") for p in out.iterdir())


def test_a_plans_own_tokenizer_in_a_bucket_names_the_model_as_a_local_one(tmp_path):
    """A plan that copies a tokenizer of its own (verl's ``huggingface/``): the model folder is
    named after the tokenizer's folder (the GGUF's ``general.name``) whether that folder is local
    or in a bucket, and holds its bytes."""
    fsspec = pytest.importorskip("fsspec")
    from streamck.plan import Plan
    from streamck.storage.url import UrlPath
    from streamck.writer.formats import sidecar

    data = b'{"model": {"type": "BPE"}}'
    local = tmp_path / "huggingface" / "tokenizer.json"
    local.parent.mkdir()
    local.write_bytes(data)
    fsspec.filesystem("memory").pipe("/review-sidecar/huggingface/tokenizer.json", data)
    for tokenizer in (local, UrlPath("memory://review-sidecar/huggingface/tokenizer.json")):
        plan = Plan([], {}, files={"config.json": b"{}"}, side_files={"tokenizer.json": tokenizer})
        folder = sidecar.model_folder(plan, "GGUF")
        assert folder.name == "huggingface" and (folder / "tokenizer.json").read_bytes() == data, tokenizer
        assert str(tokenizer.parent) in sidecar.describe(folder)


def _hf_copy(qwen3: Path, tmp_path: Path) -> Path:
    """The tiny Qwen3's folder copied (its files real, not links), to be damaged."""
    src = tmp_path / "model"
    shutil.copytree(qwen3, src)
    return src


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "config.json"])
def test_a_broken_json_beside_the_weights_is_one_line_for_gguf(qwen3, tmp_path, name):
    """A truncated JSON file the GGUF writer reads: one line naming it, exit 2, nothing written."""
    src = _hf_copy(qwen3, tmp_path)
    (src / name).write_bytes((src / name).read_bytes()[:40])
    out = tmp_path / "out.gguf"
    line = _one_line(cli("rewrite", src, "-o", out, check=2), out)
    assert name in line, line


def test_gguf_reads_no_tokenizer_that_links_out_of_the_source(qwen3, tmp_path):
    """A tokenizer.json linked to a file outside the model's folder is not read into the file:
    one line naming it, exit 2, nothing written (as -o hf leaves it out)."""
    src = _hf_copy(qwen3, tmp_path)
    outside = tmp_path / "elsewhere.json"
    (src / "tokenizer.json").rename(outside)
    (src / "tokenizer.json").symlink_to(outside)
    out = tmp_path / "out.gguf"
    line = _one_line(cli("rewrite", src, "-o", out, check=2), out)
    assert "tokenizer.json" in line and "links out" in line, line
