"""DCP and Automodel checkpoints as sources: every command, consolidated on the fly, equal
to the full tensors torch started from (tests/dcp_fixtures.py writes them with torch)."""

import json
import math
import shutil

import pytest
import torch
from helpers import cli
from safetensors.torch import load, load_file

from streamck import CheckpointError, Rules, compile_plan, open_checkpoint, write_plan
from streamck.check import diff


def sources(c):
    return {"hf": c["hf"][0].parent, "dcp": c["dcp"], "automodel": c["automodel_dir"]}


@pytest.mark.parametrize("kind", ["hf", "dcp", "automodel"])
def test_rewrite_equals_the_full_tensors(dcp_ckpts, tmp_path, kind):
    src = sources(dcp_ckpts)[kind]
    result = write_plan(compile_plan(open_checkpoint(src)), tmp_path / "out.safetensors", verify=True)
    assert result.files == [tmp_path / "out.safetensors"]
    got = load_file(tmp_path / "out.safetensors")
    want = dcp_ckpts["tensors"]
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name


def test_tiny_buffers_sharded_output_and_cast(dcp_ckpts, tmp_path):
    ckpt = open_checkpoint(dcp_ckpts["dcp"])
    plan = compile_plan(ckpt, Rules((), "bf16"))
    write_plan(plan, tmp_path / "out", chunk=64, max_shard_size=4000, verify=True)
    got = {}
    for f in sorted((tmp_path / "out").glob("*.safetensors")):
        got.update(load_file(f))
    assert len(list((tmp_path / "out").glob("*.safetensors"))) > 2
    for name, t in dcp_ckpts["tensors"].items():
        assert torch.equal(got[name], t.to(torch.bfloat16)), name


def test_stdout_ls_hash_and_diff(dcp_ckpts, tmp_path):
    hf, dcp = sources(dcp_ckpts)["hf"], dcp_ckpts["dcp"]
    out = cli("rewrite", hf, "-o", "-", "--strip-prefix", "model.", check=0, text=False)
    got = load(out.stdout)
    assert torch.equal(got["shard1_bf16"], dcp_ckpts["tensors"]["model.shard1_bf16"])
    ls = cli("ls", dcp, check=0)
    assert "model.uneven" in ls.stdout and "[1001, 3]" in ls.stdout
    assert "step: 1 non-tensor item skipped" in ls.stderr  # said once, never unpickled
    assert diff(hf, dcp, data=True).equal
    assert diff(dcp, dcp_ckpts["reference"], data=True).equal
    digests = cli("hash", dcp, check=0).stdout
    assert digests == cli("hash", dcp_ckpts["reference"], check=0).stdout


def test_automodel_run_root_and_steps(dcp_ckpts, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(dcp_ckpts["run"], run)
    step = run / f"epoch_0_step_{dcp_ckpts['step']}"
    for path in (step, step / "model"):
        assert sorted(open_checkpoint(path).tensors) == sorted(dcp_ckpts["tensors"])
    assert sorted(open_checkpoint(run, "latest").tensors) == sorted(dcp_ckpts["tensors"])
    assert open_checkpoint(run, dcp_ckpts["step"]).root == step / "model"
    refused = cli("ls", run)
    assert refused.returncode == 2 and "--step" in refused.stderr
    # Side files come from model/.hf_metadata.
    write_plan(compile_plan(open_checkpoint(step)), tmp_path / "out")
    assert (tmp_path / "out" / "config.json").read_bytes() == (step / "model/.hf_metadata/config.json").read_bytes()
    assert not (tmp_path / "out" / "fqn_to_file_index_mapping.json").exists()
    # A consolidated export, when there, is preferred over the shards.
    (step / "model/consolidated").mkdir()
    shutil.copy(dcp_ckpts["reference"], step / "model/consolidated/model.safetensors")
    assert open_checkpoint(step).root == step / "model/consolidated"
    # A step being written is refused by name.
    (step / ".incomplete").touch()
    with pytest.raises(CheckpointError, match="still being written"):
        open_checkpoint(step)


def test_latest_marker_wins_over_the_highest_step(dcp_ckpts, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(dcp_ckpts["run"], run / "x")
    (run / "x" / "epoch_0_step_10").rename(run / "epoch_0_step_10")
    (run / "epoch_1_step_20").mkdir()  # a later step that has no weights yet
    (run / "LATEST.txt").write_text("epoch_0_step_10\n")
    assert open_checkpoint(run, "latest").root == run / "epoch_0_step_10" / "model"


def test_missing_last_rank_file_is_caught_by_the_fqn_map(dcp_ckpts, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(dcp_ckpts["automodel_dir"], model)
    last = sorted(model.glob("shard-*.safetensors"))[-1]
    last.unlink()
    with pytest.raises(CheckpointError, match="fqn_to_file_index_mapping.json: names .* tensors the shards do not"):
        open_checkpoint(model)
    r = cli("rewrite", model, "-o", tmp_path / "out")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and not (tmp_path / "out").exists()


def test_missing_last_rank_file_is_caught_by_the_config(dcp_ckpts, tmp_path):
    # Without the fqn map, the shards alone still tile every tensor they hold, each one
    # shorter: only the config's sizes tell that the embedding lost the last rank's rows.
    model = tmp_path / "model"
    shutil.copytree(dcp_ckpts["automodel_dir"], model)
    (model / ".hf_metadata" / "fqn_to_file_index_mapping.json").unlink()
    assert open_checkpoint(model).tensors["model.embed_tokens.weight"].shape == (101, 48)
    sorted(model.glob("shard-*.safetensors"))[-1].unlink()
    message = r"config.json: vocab_size 101 gives 'model.embed_tokens.weight' 101 rows, the shards 51 "
    with pytest.raises(CheckpointError, match=message):
        open_checkpoint(model)
    r = cli("rewrite", model, "-o", tmp_path / "out")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"vocab_size": 128}, r"vocab_size 128 gives 'model.embed_tokens.weight' 128 rows, the shards 101"),
        ({"hidden_size": 64}, None),  # only rows are checked: columns vary by architecture
        ({"vocab_size": "101"}, None),  # not a size: nothing to check
        ({"hidden_size": None, "vocab_size": None}, None),
    ],
)
def test_config_sizes_against_the_shapes(dcp_ckpts, tmp_path, change, message):
    model = tmp_path / "model"
    shutil.copytree(dcp_ckpts["automodel_dir"], model)
    config = model / ".hf_metadata" / "config.json"
    merged = {**json.loads(config.read_text()), **change}
    config.write_text(json.dumps({k: v for k, v in merged.items() if v is not None}))
    if message is None:
        assert open_checkpoint(model).tensors["model.embed_tokens.weight"].shape == (101, 48)
    else:
        with pytest.raises(CheckpointError, match=message):
            open_checkpoint(model)


def test_eagle4_from_shards_equals_the_export_from_consolidated(tmp_path):
    import torch.distributed.checkpoint as dcp
    from eagle4_drafts import make_draft

    from streamck import export_eagle4_draft

    step, _, tensors = make_draft(tmp_path / "a" / "epoch_0_step_5", consolidated=True)
    export_eagle4_draft(step, tmp_path / "from_consolidated")
    # The same draft as Automodel saves it without consolidating: shards + .hf_metadata.
    sharded = tmp_path / "b" / "epoch_0_step_5"
    state = {k: torch.from_numpy(v) for k, v in tensors.items()}
    writer = dcp.HuggingFaceStorageWriter(path=str(sharded / "model"), save_distributed=True)
    dcp.save(state, storage_writer=writer, no_dist=True)
    (sharded / "model/.hf_metadata").mkdir()
    shutil.copy(step / "model/consolidated/config.json", sharded / "model/.hf_metadata/config.json")
    assert list((sharded / "model").glob("shard-*.safetensors"))
    export_eagle4_draft(sharded, tmp_path / "from_shards")
    for name in ("model.safetensors", "config.json"):
        a = (tmp_path / "from_consolidated" / name).read_bytes()
        assert (tmp_path / "from_shards" / name).read_bytes() == a, name


@pytest.mark.parametrize(
    ("config", "shapes", "message"),
    [
        # an EAGLE-3 draft: its head covers the draft vocabulary, its embedding the target's
        (
            {"vocab_size": 128256, "draft_vocab_size": 32000, "hidden_size": 64},
            {"model.embed_tokens.weight": (128256, 64), "lm_head.weight": (32000, 64)},
            None,
        ),
        ({"vocab_size": 128256, "draft_vocab_size": 32000}, {"lm_head.weight": (16000, 64)}, "draft_vocab_size 32000"),
        # OPT-350m projects its embedding: [vocab, word_embed_proj_dim], not [vocab, hidden_size]
        (
            {"vocab_size": 50272, "hidden_size": 1024, "word_embed_proj_dim": 512},
            {"model.decoder.embed_tokens.weight": (50272, 512), "lm_head.weight": (50272, 512)},
            None,
        ),
        ({"hidden_size": 48}, {"model.norm.weight": (24,)}, "hidden_size 48 gives 'model.norm.weight' 48 rows"),
        ({"hidden_size": 48}, {"model.layers.0.norm.weight": (24,)}, None),  # not the final norm
    ],
)
def test_config_rows_for_real_architectures(tmp_path, config, shapes, message):
    from streamck.source.crosscheck import cross_check
    from streamck.source.header import TensorRef

    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = {n: TensorRef(n, "BF16", s, tmp_path / "x", 0, 2 * math.prod(s)) for n, s in shapes.items()}
    if message is None:
        cross_check(tmp_path, tensors)
    else:
        with pytest.raises(CheckpointError, match=message):
            cross_check(tmp_path, tensors)
