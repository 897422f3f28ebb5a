"""--plan eagle4 against docs/eagle4.md: exports and every refusal."""

import json
import subprocess
import sys

import numpy as np
import pytest
from eagle4_drafts import BASE_CONFIG, make_draft, serving_name
from helpers import metadata_of, read_all, says_the_plan

from streamck import OutputError, PlanError, export_eagle4_draft

# The serving config's copied keys, as the contract (docs/eagle4.md) lists them: written
# out here, not imported from the implementation's table, so that the test can disagree.
CONTRACT_COPIED = """attention_bias attention_dropout bos_token_id eagle_config efficient_lm_head_candidates
efficient_lm_head_rank eos_token_id head_dim hidden_act hidden_size intermediate_size max_position_embeddings
mlp_bias num_attention_heads num_key_value_heads pad_token_id rms_norm_eps rope_scaling rope_theta sliding_window
target_hidden_size tie_word_embeddings torch_dtype vocab_size""".split()

VARIANTS = {
    "plain": ({}, {}),
    "head_dim": ({"head_dim": 8}, {}),
    "target_hidden": ({"target_hidden_size": 24}, {}),
    "gqa": ({"num_key_value_heads": 2}, {}),
    "biases": ({"attention_bias": True, "mlp_bias": True}, {}),
    "sharded": ({}, {"shards": 3}),
    "consolidated": ({}, {"consolidated": True}),
    "sharded_consolidated_bf16src": ({"num_key_value_heads": 1, "head_dim": 6}, {"shards": 2, "consolidated": True}),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_export_matches_contract(tmp_path, variant):
    overrides, layout = VARIANTS[variant]
    src, config, tensors = make_draft(tmp_path / "step", overrides, **layout)
    out = export_eagle4_draft(src, tmp_path / "export")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    served = json.loads((out / "config.json").read_text())
    expected = {k: config[k] for k in CONTRACT_COPIED if k in config}
    expected |= {"architectures": ["LlamaForCausalLMEagle4"], "model_type": "llama", "num_hidden_layers": 1}
    assert served == expected
    assert (out / "config.json").read_text() == json.dumps(expected, indent=2, sort_keys=True) + "\n"
    got = read_all(out / "model.safetensors")
    assert sorted(got) == sorted(serving_name(k) for k in tensors)
    for train, arr in tensors.items():
        assert got[serving_name(train)].dtype == arr.dtype
        assert np.array_equal(got[serving_name(train)], arr)
    assert metadata_of(out / "model.safetensors") == {"format": "pt"}


def test_two_runs_byte_identical(tmp_path):
    src, _, _ = make_draft(tmp_path / "step", shards=2, consolidated=True)
    a = export_eagle4_draft(src, tmp_path / "a")
    b = export_eagle4_draft(src, tmp_path / "b")
    for name in ("config.json", "model.safetensors"):
        assert (a / name).read_bytes() == (b / name).read_bytes()


def test_dtype_cast_and_torch_dtype(tmp_path):
    import torch
    from safetensors.torch import load_file

    src, _, tensors = make_draft(tmp_path / "step")
    out = export_eagle4_draft(src, tmp_path / "out", dtype="bf16")
    got = load_file(out / "model.safetensors")
    for train, arr in tensors.items():
        assert torch.equal(got[serving_name(train)], torch.from_numpy(arr).to(torch.bfloat16))
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def _refused(tmp_path, overrides=None, match="", **kw):
    src, _, _ = make_draft(tmp_path / "step", overrides, **kw)
    with pytest.raises(PlanError, match=match):
        export_eagle4_draft(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "key",
    [
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "rms_norm_eps",
        "efficient_lm_head_rank",
    ],
)
def test_missing_required_key(tmp_path, key):
    src, config, _ = make_draft(tmp_path / "step")
    del config[key]
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(PlanError, match=f"required key '{key}' is missing"):
        export_eagle4_draft(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_aux_layer_ids(tmp_path):
    src, config, _ = make_draft(tmp_path / "step")
    config["eagle_config"] = {}
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(PlanError, match="eagle_config.eagle_aux_hidden_state_layer_ids' is missing"):
        export_eagle4_draft(src, tmp_path / "out")


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("hidden_size", "16", "hidden_size must be a positive integer, not '16'"),
        ("vocab_size", 0, "vocab_size must be a positive integer"),
        ("efficient_lm_head_rank", -3, "efficient_lm_head_rank must be a positive integer"),
        ("efficient_lm_head_rank", 6.0, "efficient_lm_head_rank must be a positive integer"),
        ("rms_norm_eps", "1e-5", "rms_norm_eps must be a positive number"),
        ("head_dim", True, "head_dim must be a positive integer"),
        ("attention_bias", "yes", "attention_bias must be true or false"),
        ("eagle_config", {"eagle_aux_hidden_state_layer_ids": []}, "non-empty list of integers"),
        ("eagle_config", {"eagle_aux_hidden_state_layer_ids": [1, "2"]}, "non-empty list of integers"),
    ],
)
def test_mistyped_config_key(tmp_path, key, value, match):
    src, config, _ = make_draft(tmp_path / "step")
    config[key] = value
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(PlanError, match=match):
        export_eagle4_draft(src, tmp_path / "out")


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"draft_vocab_size": 32}, "draft_vocab_size 32 differs from vocab_size 50"),
        ({"parallel_drafting": True}, "parallel_drafting: true"),
        ({"fc_norm": True}, "fc_norm: true"),
        (
            {"eagle_config": {**BASE_CONFIG["eagle_config"], "parallel_drafting": True}},
            "eagle_config.parallel_drafting",
        ),
    ],
)
def test_unsupported_structure(tmp_path, overrides, match):
    _refused(tmp_path, overrides, match=match)


def test_same_draft_vocab_size_is_fine(tmp_path):
    src, _, _ = make_draft(tmp_path / "step", {"draft_vocab_size": 50})
    export_eagle4_draft(src, tmp_path / "out")


def test_second_draft_layer(tmp_path):
    def add_layer(t):
        t["model.layers.1.mlp.up_proj.weight"] = np.zeros((40, 16), np.float32)

    _refused(
        tmp_path, match="model.layers.1.mlp.up_proj.weight belongs to a second draft layer", tensors_edit=add_layer
    )


def test_missing_and_unexpected_listed_together(tmp_path):
    def edit(t):
        del t["efficient_lm_head.weight"]
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.zeros(4, np.float32)

    _refused(
        tmp_path,
        match="1 missing: efficient_lm_head.weight; 1 unexpected: model.layers.0.self_attn.rotary_emb.inv_freq",
        tensors_edit=edit,
    )


def test_bias_without_flag_is_unexpected(tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.q_proj.bias"] = np.zeros(16, np.float32)

    _refused(tmp_path, match="1 unexpected: model.layers.0.self_attn.q_proj.bias", tensors_edit=edit)


def test_many_unexpected_get_a_count(tmp_path):
    def edit(t):
        for i in range(30):
            t[f"extra.{i:02d}"] = np.zeros(1, np.float32)

    _refused(tmp_path, match=r"30 unexpected: extra.00, .*\(30 in all\)", tensors_edit=edit)


def test_wrong_shape_names_expected_found_and_config_keys(tmp_path):
    def edit(t):
        t["model.fc.weight"] = np.zeros((16, 32), np.float32)

    _refused(
        tmp_path,
        tensors_edit=edit,
        match=r"model.fc.weight has shape \[16, 32\], expected \[16, 48\] = \[H, A\*T\] from H = hidden_size, "
        r"A = len\(eagle_config.eagle_aux_hidden_state_layer_ids\), T = target_hidden_size",
    )


def test_integer_tensor_refused(tmp_path):
    def edit(t):
        t["model.norm.weight"] = np.zeros(16, np.int32)

    _refused(tmp_path, match="model.norm.weight is I32", tensors_edit=edit)


def test_no_config_names_both_places(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(PlanError, match="no config.json in .*empty nor in .*empty/model/consolidated or"):
        export_eagle4_draft(tmp_path / "empty", tmp_path / "out")


@pytest.mark.parametrize("how", ["same", "symlink", "step_of_consolidated"])
def test_output_equal_to_checkpoint_dir_refused(tmp_path, how):
    src, _, _ = make_draft(tmp_path / "step", consolidated=how == "step_of_consolidated")
    out = {"same": src, "symlink": tmp_path / "link", "step_of_consolidated": tmp_path / "step"}[how]
    if how == "symlink":
        out.symlink_to(src)
    before = sorted(p.name for p in src.rglob("*"))
    with pytest.raises(OutputError, match="source"):
        export_eagle4_draft(src, out, force=True)
    assert sorted(p.name for p in src.rglob("*")) == before


def test_cli_export_and_dry_run(tmp_path):
    src, _, _ = make_draft(tmp_path / "step", consolidated=True)

    def run(*a):
        return subprocess.run(
            [sys.executable, "-m", "streamck", "rewrite", str(src), *a],
            capture_output=True,
            text=True,
        )

    dry = run("-o", str(tmp_path / "x"), "--plan", "eagle4", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "EAGLE-4 draft: H=16, T=16, A=3, heads=4, kv_heads=4, head_dim=4, I=40, V=50, R=6" in dry.stdout
    assert '"architectures": [' in dry.stdout and "model.fc.weight" in dry.stdout
    assert not (tmp_path / "x").exists()
    proc = run("-o", str(tmp_path / "x"), "--plan", "eagle4", "-q")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "x").iterdir()) == ["config.json", "model.safetensors"]
    bad = run("-o", str(tmp_path / "y"), "--plan", "eagle4", "--strip-prefix", "model.")
    assert bad.returncode == 2 and "cannot be combined" in bad.stderr
    shard = run("-o", str(tmp_path / "y"), "--plan", "eagle4", "--max-shard-size", "1KB")
    assert shard.returncode == 2 and "exactly one model.safetensors" in shard.stderr
    assert not (tmp_path / "y").exists()


def test_dry_run_manifest_matches_the_export(tmp_path):
    from streamck.check import diff

    src, _, tensors = make_draft(tmp_path / "step", {"attention_bias": True}, shards=2)
    proc = subprocess.run(
        [sys.executable, "-m", "streamck", "rewrite", str(src), "--plan", "eagle4", "--dry-run", "--json"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    (tmp_path / "now.json").write_text(proc.stdout)
    manifest = json.loads(proc.stdout)
    assert sorted(manifest["tensors"]) == sorted(serving_name(k) for k in tensors)
    assert manifest["metadata"] == {"format": "pt"}
    out = export_eagle4_draft(src, tmp_path / "export")
    assert diff(tmp_path / "now.json", out / "model.safetensors").equal


def test_without_the_plan_a_note_names_it(tmp_path):
    """Issue #36: an EAGLE-4 draft step rewritten or listed without --plan names the plan."""
    src, _, _ = make_draft(tmp_path / "step", consolidated=True)
    says_the_plan(src, "eagle4")
