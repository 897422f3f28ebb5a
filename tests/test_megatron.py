"""``--plan megatron-gpt`` on checkpoints megatron-core 0.19.2's own ``dist_checkpointing.save``
wrote (GPTModel, tensor parallel 2, gloo: bench/megatron_ckpt.py). Oracles: megatron-core's
own TP=2 forward against transformers loading the output, and megatron-core's own reader
(``dist_checkpointing.load`` at TP=1) tensor for tensor."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from helpers import cli, fixture_root, missing, says_the_plan, script_checkpoints
from megatron_args import with_args

torch = pytest.importorskip("torch")

HERE = Path(__file__).parent
BENCH = HERE.parent / "bench"  # the trainers' own checkpointing code, shared with the bench
PLAN = "megatron-gpt"
# megatron-core 0.19.2 declares Python >= 3.12 but runs here from its unpacked wheel (scripts/test).
MEGATRON = os.environ.get("STREAMCK_MEGATRON_PATH", str(HERE.parent / ".venv" / "megatron-core-0.19.2"))


@pytest.fixture(scope="session")
def megatron(request, tmp_path_factory) -> dict[str, Path]:
    """The fixture run folders by model name, built once per version of the fixture script and of the
    installed packages, kept on the machine (tests/fixture_cache.py)."""
    base = fixture_root(tmp_path_factory, "megatron", BENCH / "megatron_ckpt.py", BENCH / "standins.py") / "megatron"
    if not (base / "done").exists() and not Path(MEGATRON, "megatron", "core").is_dir():
        missing(f"megatron-core 0.19.2 is not unpacked at {MEGATRON} (scripts/test does it)")

    path = os.pathsep.join([str(BENCH), MEGATRON, os.environ.get("PYTHONPATH", "")])
    code = (BENCH / "megatron_ckpt.py", BENCH / "standins.py")
    return script_checkpoints(tmp_path_factory, "megatron", *code, env={"PYTHONPATH": path})


def _load(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def _logits(folder: Path, oracle: Path, state: dict | None = None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    if state is not None:
        model.load_state_dict(state, strict=False)
    data = torch.load(oracle)
    with torch.no_grad():
        return model(data["tokens"]).logits, data["logits"]


@pytest.mark.parametrize("name", ["gpt", "gpt_bias", "gpt_qk"])
def test_logits_match_megatron_forward(megatron, tmp_path, name):
    """From the run root (tracker file), with the config beside it checked against args."""
    cli("rewrite", megatron[name], "-o", tmp_path / "hf", "--plan", PLAN, check=0)
    got, want = _logits(tmp_path / "hf", megatron[name] / "oracle.pt")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["gpt", "gpt_bias", "gpt_qk"])
def test_config_from_args_alone(megatron, tmp_path, name):
    """An iteration folder with no config anywhere: config.json is built from Megatron's args."""
    step = tmp_path / "iter_0000010"
    shutil.copytree(megatron[name] / "iter_0000010", step)
    proc = cli("rewrite", step, "-o", tmp_path / "hf", "--plan", PLAN, "--dry-run", check=0)
    assert "iteration 10" in proc.stdout and "sizes from its args" in proc.stdout
    cli("rewrite", step, "-o", tmp_path / "hf", "--plan", PLAN, check=0)
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    given = json.loads((megatron[name] / "config.json").read_text())
    assert written["model_type"] == given["model_type"] and written["vocab_size"] == given["vocab_size"]
    got, want = _logits(tmp_path / "hf", megatron[name] / "oracle.pt")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["gpt", "gpt_bias"])
def test_same_rows_as_megatron_reader(megatron, tmp_path, name):
    """Each output is the rows megatron-core's own TP=1 load holds: q, k, v of each query group
    fused back give linear_qkv, gate and up give linear_fc1, the vocabulary its first rows."""
    cli("rewrite", megatron[name], "-o", tmp_path / "hf", "--plan", PLAN, check=0)
    got, full = _load(tmp_path / "hf" / "model.safetensors"), _load(megatron[name] / "full.safetensors")
    config = json.loads((megatron[name] / "config.json").read_text())
    groups, vocab = config["num_key_value_heads"], config["vocab_size"]
    assert torch.equal(got["model.embed_tokens.weight"], full["embedding.word_embeddings.weight"][:vocab])
    assert torch.equal(got["model.norm.weight"], full["decoder.final_layernorm.weight"])
    for i in range(config["num_hidden_layers"]):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        for part in ("weight", "bias") if name == "gpt_bias" else ("weight",):
            q, k, v = (got[f"{hf}self_attn.{x}_proj.{part}"] for x in "qkv")
            per = [t.reshape(groups, -1, *t.shape[1:]) for t in (q, k, v)]
            fused = torch.cat(per, dim=1).reshape(-1, *q.shape[1:])
            assert torch.equal(fused, full[f"{mg}self_attention.linear_qkv.{part}"]), (i, part)
        gate_up = torch.cat([got[f"{hf}mlp.gate_proj.weight"], got[f"{hf}mlp.up_proj.weight"]])
        assert torch.equal(gate_up, full[f"{mg}mlp.linear_fc1.weight"])
        assert torch.equal(got[f"{hf}mlp.down_proj.weight"], full[f"{mg}mlp.linear_fc2.weight"])
        assert torch.equal(got[f"{hf}self_attn.o_proj.weight"], full[f"{mg}self_attention.linear_proj.weight"])
        assert torch.equal(got[f"{hf}input_layernorm.weight"], full[f"{mg}input_layernorm.weight"])
        assert torch.equal(got[f"{hf}post_attention_layernorm.weight"], full[f"{mg}pre_mlp_layernorm.weight"])


def test_contiguous_qkv_split_would_be_wrong(megatron, tmp_path):
    """The control: q|k|v cut as three contiguous blocks loads without a word and is wrong."""
    cli("rewrite", megatron["gpt"], "-o", tmp_path / "hf", "--plan", PLAN, check=0)
    full = _load(megatron["gpt"] / "full.safetensors")
    wrong = {}
    for i in range(2):
        qkv = full[f"decoder.layers.{i}.self_attention.linear_qkv.weight"]
        for x, rows in zip("qkv", qkv.split([64, 32, 32]), strict=True):
            wrong[f"model.layers.{i}.self_attn.{x}_proj.weight"] = rows
    got, want = _logits(tmp_path / "hf", megatron["gpt"] / "oracle.pt", wrong)
    assert (got - want).abs().max() > 1e-2


def test_dtype_follows_cast(megatron, tmp_path):
    cli("rewrite", megatron["gpt"], "-o", tmp_path / "hf", "--plan", PLAN, "--dtype", "bf16", check=0)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    got, full = _load(tmp_path / "hf" / "model.safetensors"), _load(megatron["gpt"] / "full.safetensors")
    assert torch.equal(got["lm_head.weight"], full["output_layer.weight"][:250].to(torch.bfloat16))


def _copy(megatron, tmp: Path, name: str = "gpt") -> Path:
    run = tmp / "run"
    shutil.copytree(megatron[name], run)
    return run


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_refused_before_writing(megatron, tmp_path):
    out = tmp_path / "hf"

    def refused(src, *extra) -> str:
        proc = cli("rewrite", src, "-o", out, "--plan", PLAN, *extra, check=2)
        assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr and not out.exists()
        return proc.stderr

    run = _copy(megatron, tmp_path)
    _edit_json(run / "config.json", hidden_size=32)
    assert "hidden_size is 32, the checkpoint's args say 64" in refused(run)
    _edit_json(run / "config.json", hidden_size=64, vocab_size=300)
    assert "vocab_size 300 exceeds the checkpoint's 256 rows" in refused(run)
    _edit_json(run / "config.json", vocab_size=250, model_type="qwen2")
    message = "model_type 'qwen2' does not build this checkpoint's model (no qkv bias or q/k norms: 'llama')"
    assert message in refused(run)
    _edit_json(run / "config.json", model_type="llama", attention_bias=True)
    assert "model_type 'llama' does not build" in refused(run)
    _edit_json(run / "config.json", attention_bias=False, tie_word_embeddings=True)
    assert "the config ties the output head, the checkpoint has its output_layer.weight" in refused(run)
    (run / "latest_checkpointed_iteration.txt").write_text("20")
    assert "latest_checkpointed_iteration.txt says '20', and there is no such iteration folder" in refused(run)
    _edit_json(run / "iter_0000010" / "metadata.json", sharded_backend="zarr")
    assert "sharded_backend 'zarr': --plan megatron-gpt reads torch_dist checkpoints" in refused(run / "iter_0000010")
    (run / "latest_checkpointed_iteration.txt").unlink()
    assert "is not a Megatron dist checkpoint (no metadata.json); iterations here: iter_0000010" in refused(run)
    assert "--hf-config: no such file" in refused(megatron["gpt"], "--hf-config", tmp_path / "none.json")
    legacy = tmp_path / "iter_0000003"
    (legacy / "mp_rank_00").mkdir(parents=True)
    assert "a legacy mp_rank_* checkpoint: save with --ckpt-format torch_dist" in refused(legacy)


class _Shell:
    """What a hostile ``common_state`` would hold: unpickling it runs a shell command."""

    def __init__(self, mark: Path):
        self.mark = mark

    def __reduce__(self):
        return (os.system, (f"touch {self.mark}",))


def _dcp_run(tmp: Path, common) -> Path:
    """An iteration folder written by torch's dcp.save with megatron's metadata.json, holding
    one model tensor and ``common`` as its common_state item."""
    import torch.distributed.checkpoint as dcp

    step = tmp / "iter_0000001"
    state = {"embedding.word_embeddings.weight": torch.zeros(8, 4), "common_state/shard_0_1": common}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(step)), no_dist=True)
    (step / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))
    return step


def test_hostile_args_are_refused_never_run(tmp_path):
    mark = tmp_path / "ran"
    step = _dcp_run(tmp_path, {"args": _Shell(mark), "iteration": 1})
    proc = cli("rewrite", step, "-o", tmp_path / "hf", "--plan", PLAN, check=2)
    assert "the common_state item: data.pkl refused: refusing to load" in proc.stderr and "system" in proc.stderr
    assert not mark.exists() and not (tmp_path / "hf").exists()


def test_without_args_the_config_gives_the_sizes(tmp_path):
    step = _dcp_run(tmp_path, {"iteration": 1})
    proc = cli("rewrite", step, "-o", tmp_path / "hf", "--plan", PLAN, check=2)
    assert "needs the model's Hugging Face config.json for its sizes: give --hf-config FILE" in proc.stderr
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 4, "num_attention_heads": 2,
                                  "intermediate_size": 8, "num_hidden_layers": 1, "vocab_size": 8}))  # fmt: skip
    proc = cli("rewrite", step, "-o", tmp_path / "hf", "--plan", PLAN, "--hf-config", config, check=2)
    assert "model tensors do not match a GPTModel (1 layers)" in proc.stderr and "missing" in proc.stderr


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_attention_heads": 0}, "args.num_attention_heads must be a positive integer, not 0"),
        ({"group_query_attention": True, "num_query_groups": None}, "args.num_query_groups must be a positive"),
        ({"group_query_attention": True, "num_query_groups": 3}, "is not a multiple of args.num_query_groups 3"),
        ({"vocab_size": 300}, "args.vocab_size 300 exceeds args.padded_vocab_size 256"),
        ({"kv_channels": 15, "rotary_interleaved": True}, "args.rotary_interleaved with an odd head dim 15"),
        ({"hidden_size": 30, "kv_channels": None}, "args.hidden_size 30 is not divisible"),
        ({"num_layers": 3}, "has shape [2, 64], expected [3, 64] = [L, H]"),
        # what transformers' Llama cannot hold (#42): refused, not written as a different model
        ({"use_rope_scaling": True}, "args.use_rope_scaling is set: Llama 3.1 RoPE scaling"),
        ({"rotary_percent": 0.5}, "args.rotary_percent is 0.5: --plan megatron-gpt converts models with 1.0"),
        ({"layernorm_zero_centered_gamma": True}, "args.layernorm_zero_centered_gamma is set: zero-centred"),
    ],
)
def test_bad_args_are_refused_before_writing(megatron, tmp_path, changes, message):
    run = with_args(_copy(megatron, tmp_path), **changes)
    proc = cli("rewrite", run, "-o", tmp_path / "hf", "--plan", PLAN, check=2)
    assert message in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr and not (tmp_path / "hf").exists()


def test_rewritten_args_still_convert(megatron, tmp_path):
    """The args rewriting above keeps a good checkpoint good (the refusals are the values')."""
    run = with_args(_copy(megatron, tmp_path))
    cli("rewrite", run, "-o", tmp_path / "hf", "--plan", PLAN)
    assert (tmp_path / "hf" / "config.json").is_file()


def test_every_command_reads_a_run_root(megatron, tmp_path):
    """ls, hash and diff take the run root rewrite takes (its tracker names the step, said in a
    note), and --step picks iter_NNNNNNN folders; with --plan they show what the plan writes."""
    run = tmp_path / "run"  # as Megatron's training loop leaves it (the fixture's oracles left behind)
    shutil.copytree(megatron["gpt"] / "iter_0000010", run / "iter_0000010")
    for name in ("latest_checkpointed_iteration.txt", "config.json"):
        shutil.copy(megatron["gpt"] / name, run / name)
    listed = cli("ls", run, "--json", check=0)
    assert "--step latest: iter_0000010 (latest_checkpointed_iteration.txt)" in listed.stderr
    direct = cli("ls", run / "iter_0000010", "--json", check=0)
    assert json.loads(listed.stdout) == json.loads(direct.stdout)
    assert "decoder.layers.self_attention.linear_qkv.weight" in json.loads(listed.stdout)["tensors"]
    assert cli("ls", run, "--step", "10", "--json", check=0).stdout == direct.stdout
    assert "no step 3 here (steps: 10)" in cli("ls", run, "--step", "3", check=2).stderr
    assert cli("hash", run, check=0).stdout == cli("hash", run / "iter_0000010", check=0).stdout
    assert cli("diff", run, run / "iter_0000010", check=0).returncode == 0

    planned = json.loads(cli("ls", run, "--plan", PLAN, "--json", check=0).stdout)
    cli("rewrite", run, "-o", tmp_path / "hf", "--plan", PLAN, check=0)
    written = json.loads(cli("ls", tmp_path / "hf", "--json", check=0).stdout)
    assert planned["tensors"] == written["tensors"] and "model.layers.0.self_attn.q_proj.weight" in planned["tensors"]
    refused = cli("diff", run, tmp_path / "hf", "--plan", PLAN, check=2).stderr  # --plan reads both sides
    assert "hf: is not a Megatron dist checkpoint" in refused
    assert cli("diff", run, run, "--plan", PLAN, check=0).returncode == 0
    (tmp_path / "planned.json").write_text(json.dumps(planned))  # a golden key set for CI
    assert cli("diff", tmp_path / "planned.json", tmp_path / "hf", check=0).returncode == 0
    hashed = cli("hash", run, "--plan", PLAN, "--json", check=0).stdout
    assert (
        json.loads(hashed)["tensors"] == json.loads(cli("hash", tmp_path / "hf", "--json", check=0).stdout)["tensors"]
    )


def test_library_takes_one_source_description(megatron):
    """streamck.ls/hash/build_plan take a SourceSpec, or its fields as keywords."""
    import streamck
    from streamck.spec import SourceSpec

    spec = SourceSpec(megatron["gpt"], plan=PLAN)
    assert streamck.ls(spec) == streamck.ls(megatron["gpt"], plan=PLAN)
    assert [t.name for t in streamck.build_plan(spec).tensors] == sorted(
        streamck.ls(spec)["tensors"], key=[t.name for t in streamck.build_plan(spec).tensors].index
    )
    with pytest.raises(streamck.UsageError, match="unknown source option"):
        streamck.ls(megatron["gpt"], stpe=10)


def test_without_the_plan_a_note_names_it(megatron, tmp_path):
    """Issue #36: a Megatron iteration (or its run root, read at the tracker's step) rewritten
    or listed without --plan names the plan."""
    run = tmp_path / "run"  # as Megatron's training loop leaves it (the fixture's oracles left behind)
    shutil.copytree(megatron["gpt"] / "iter_0000010", run / "iter_0000010")
    shutil.copy(megatron["gpt"] / "latest_checkpointed_iteration.txt", run)
    shutil.copy(megatron["gpt"] / "config.json", run)
    says_the_plan(run / "iter_0000010", PLAN)
    says_the_plan(run, PLAN)
