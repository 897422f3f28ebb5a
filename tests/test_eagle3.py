"""--plan eagle3 and --plan eagle3-speculators: exports of steps NeMo Automodel's own code
writes, checked tensor by tensor against the source, against what vLLM's and SGLang's loaders
build, against speculators itself, and every refusal. The aux layer ids and the serving
config against each engine's reading rules: test_eagle3_serving.py."""

import json
import subprocess
import sys

import numpy as np
import pytest
from eagle3_drafts import engine_load, engine_params, engine_shape, make_draft, serving_name, speculators_as_vllm
from helpers import cli, metadata_of, read_all, says_the_plan

from streamck import PlanError, UsageError
from streamck.api import rewrite

VERIFIER = "meta-llama/Llama-3.1-8B-Instruct"

VARIANTS = {
    "same_vocab": {},
    "draft_vocab": {"recipe": {"draft_vocab_size": 32}},
    "fc_norm": {"recipe": {"fc_norm": True, "norm_output": True}},
    "gqa_head_dim": {"target_edit": {"num_key_value_heads": 1, "head_dim": 8}},
    "target_hidden": {"recipe": {"fc_norm": True}, "draft_edit": {"target_hidden_size": 24}},
    "qwen3": {"target": "qwen3", "recipe": {"draft_vocab_size": 40, "aux_layer_ids": [3, 18, 30]}},
    "sharded": {"recipe": {"draft_vocab_size": 20}, "shards": 3},
    "flat": {"target": "qwen3", "consolidated": False},
    "sharded_flat": {"recipe": {"draft_vocab_size": 40}, "shards": 2, "consolidated": False},
}
# speculators builds fc and fc_norm on hidden_size: T != H is --plan eagle3 only.
SPECULATORS_VARIANTS = [v for v in VARIANTS if v != "target_hidden"]


def export(src, out, plan="eagle3", **kw):
    rewrite(src, out, plan=plan, **kw)
    return out


def expected_native_config(config: dict) -> dict:
    """The serving config, in this test's words: Llama keys copied, the rest set (the aux ids
    are checked against the engines' own rules in test_eagle3_serving.py)."""
    copied = [
        "attention_dropout",
        "bos_token_id",
        "dtype",
        "eos_token_id",
        "head_dim",
        "hidden_act",
        "hidden_size",
        "intermediate_size",
        "max_position_embeddings",
        "num_attention_heads",
        "num_key_value_heads",
        "pad_token_id",
        "rms_norm_eps",
        "rope_parameters",
        "vocab_size",
    ]
    return {k: config[k] for k in copied} | {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "layer_types": ["full_attention"],
        "num_aux_hidden_states": 3,
        "draft_vocab_size": config["draft_vocab_size"],
        "target_hidden_size": config["target_hidden_size"],
        "tie_word_embeddings": False,
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": config["fc_norm"],
        "norm_output": config["norm_output"],
    }


def assert_tensors_match(out, tensors):
    got = read_all(out / "model.safetensors")
    assert sorted(got) == sorted(serving_name(k) for k in tensors)
    for train, arr in tensors.items():
        assert got[serving_name(train)].dtype == arr.dtype, train
        assert got[serving_name(train)].shape == arr.shape, train
        assert np.array_equal(got[serving_name(train)], arr), train
    assert metadata_of(out / "model.safetensors") == {"format": "pt"}
    return got


@pytest.mark.parametrize("variant", VARIANTS)
def test_native_export_matches_source(tmp_path, variant):
    src, config, tensors = make_draft(tmp_path / "step", **VARIANTS[variant])
    out = export(src, tmp_path / "export")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    served = json.loads((out / "config.json").read_text())
    ids = served.pop("eagle_aux_hidden_state_layer_ids"), served.pop("eagle_config")
    assert served == expected_native_config(config)
    assert all(isinstance(k, int) for k in ids[0]) and len(ids[0]) == 3
    for gone in ("_name_or_path", "attn_implementation", "parallel_drafting", "id2label", "use_cache", "torch_dtype"):
        assert gone not in served
    got = assert_tensors_match(out, tensors)
    assert ("d2t" in got) == (config["draft_vocab_size"] < config["vocab_size"])


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_native_export_is_what_the_engines_load(tmp_path, variant, engine):
    """Every parameter the engine builds from the served config gets a checkpoint key, with
    the shape it expects, and every key lands in a parameter (or is the vocab map)."""
    src, _, _ = make_draft(tmp_path / "step", **VARIANTS[variant])
    out = export(src, tmp_path / "export")
    served = json.loads((out / "config.json").read_text())
    keys = {k: tuple(v.shape) for k, v in read_all(out / "model.safetensors").items()}
    params = engine_params(served, engine)
    landed = {engine_load(k, engine) for k in keys} - {None}
    assert landed == set(params), (sorted(set(params) - landed), sorted(landed - set(params)))
    for param, shape in params.items():
        assert engine_shape(keys, param) == shape, param


@pytest.mark.parametrize("variant", SPECULATORS_VARIANTS)
def test_speculators_export_loads_strictly(tmp_path, variant):
    import torch  # speculators is installed by scripts/test: missing, this fails rather than skips
    from safetensors.torch import load_file
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    src, config, tensors = make_draft(tmp_path / "step", **VARIANTS[variant])
    out = export(src, tmp_path / "export", plan="eagle3-speculators", verifier=VERIFIER)
    body = json.loads((out / "config.json").read_text())
    assert body["speculators_model_type"] == "eagle3"
    assert body["speculators_config"]["verifier"]["name_or_path"] == VERIFIER
    for key in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "draft_vocab_size"):
        assert key in body  # written out: vLLM's adapter defaults norm_before_residual to true
    assert body["norm_before_residual"] is False
    assert body["transformer_layer_config"]["num_hidden_layers"] == 1

    spec = Eagle3SpeculatorConfig.model_validate(body)  # speculators' own validation
    assert spec.transformer_layer_config.model_type == "llama"
    assert spec.draft_vocab_size == config["draft_vocab_size"]
    assert spec.fc_norm is config["fc_norm"] and spec.norm_output is config["norm_output"]
    model = Eagle3DraftModel(spec)
    exported = load_file(out / "model.safetensors")
    own = model.state_dict()
    # What speculators leaves out of its own saves (the verifier's head and norm) is all that
    # the export lacks; everything else must load strictly, shapes and dtypes included.
    assert set(own) - set(exported) == set(model._keys_to_ignore_on_save)
    model.load_state_dict(exported | {k: own[k] for k in model._keys_to_ignore_on_save}, strict=True)
    loaded = model.state_dict()
    for train, arr in tensors.items():
        assert torch.equal(loaded[serving_name(train)], torch.from_numpy(arr)), train
    # and what vLLM builds from it through its speculators adapter takes every key
    keys = {k: tuple(v.shape) for k, v in exported.items()}
    params = engine_params(
        speculators_as_vllm(body) | {"head_dim": body["transformer_layer_config"]["head_dim"]}, "vllm"
    )
    assert {engine_load(k, "vllm") for k in keys} - {None} == set(params)
    for param, shape in params.items():
        assert engine_shape(keys, param) == shape, param


def test_speculators_and_native_hold_the_same_bytes(tmp_path):
    src, _, _ = make_draft(tmp_path / "step", {"draft_vocab_size": 30, "fc_norm": True}, shards=2)

    a = export(src, tmp_path / "a")
    b = export(src, tmp_path / "b", plan="eagle3-speculators", verifier=VERIFIER)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


def test_two_runs_byte_identical(tmp_path):
    src, _, _ = make_draft(tmp_path / "step", {"draft_vocab_size": 30}, shards=2)
    for plan, kw in (("eagle3", {}), ("eagle3-speculators", {"verifier": VERIFIER})):
        a = export(src, tmp_path / f"{plan}-a", plan=plan, **kw)
        b = export(src, tmp_path / f"{plan}-b", plan=plan, **kw)
        for name in ("config.json", "model.safetensors"):
            assert (a / name).read_bytes() == (b / name).read_bytes()


def test_dtype_cast_leaves_vocab_map_alone(tmp_path):
    import torch
    from safetensors.torch import load_file

    src, _, tensors = make_draft(tmp_path / "step", {"draft_vocab_size": 32})
    out = export(src, tmp_path / "out", dtype="bf16")
    got = load_file(out / "model.safetensors")
    for train, arr in tensors.items():
        want = torch.from_numpy(arr)
        want = want.to(torch.bfloat16) if want.is_floating_point() else want
        assert got[serving_name(train)].dtype == want.dtype and torch.equal(got[serving_name(train)], want)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    spec = export(src, tmp_path / "spec", plan="eagle3-speculators", verifier=VERIFIER, dtype="fp16")
    body = json.loads((spec / "config.json").read_text())
    assert body["dtype"] == body["transformer_layer_config"]["dtype"] == "float16"
    assert "torch_dtype" not in body and "torch_dtype" not in body["transformer_layer_config"]


def _refused(tmp_path, match="", plan="eagle3", recipe=None, **kw):
    verifier = {"verifier": VERIFIER} if plan == "eagle3-speculators" else {}
    src, _, _ = make_draft(tmp_path / "step", recipe, **kw)
    with pytest.raises(PlanError, match=match):
        export(src, tmp_path / "out", plan=plan, **verifier)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("plan", ["eagle3", "eagle3-speculators"])
def test_parallel_drafting_refused(tmp_path, plan):
    # Automodel builds the P-EAGLE draft (mask_hidden) from the recipe's parallel_drafting
    _refused(tmp_path, "parallel_drafting: true .*P-EAGLE", plan=plan, draft_edit={"parallel_drafting": True})


def test_pard_token_refused(tmp_path):
    _refused(tmp_path, "pard_token marks a P-EAGLE draft", json_edit={"pard_token": 49})


def test_mask_hidden_refused(tmp_path):
    def edit(t):
        t["mask_hidden"] = np.zeros((1, 1, 48), np.float32)

    _refused(tmp_path, "mask_hidden marks a P-EAGLE draft.*vLLM only", tensors_edit=edit)


def test_second_layer_refused(tmp_path):
    def edit(t):
        t["model.layers.1.mlp.up_proj.weight"] = np.zeros((40, 16), np.float32)
        t["model.layers.1.input_layernorm.weight"] = np.zeros(16, np.float32)

    _refused(
        tmp_path,
        r"model.layers.1.input_layernorm.weight belongs to a second draft layer.*\(2 such tensors\)",
        tensors_edit=edit,
    )


def test_vocab_map_present_with_full_vocab_refused(tmp_path):
    def edit(t):
        t["d2t"] = np.zeros(50, np.int64)
        t["t2d"] = np.ones(50, np.bool_)

    _refused(tmp_path, "d2t and t2d present but draft_vocab_size equals vocab_size", tensors_edit=edit)


@pytest.mark.parametrize("gone", [("d2t",), ("t2d",), ("d2t", "t2d")])
def test_vocab_map_missing_with_draft_vocab_refused(tmp_path, gone):
    def edit(t):
        for k in gone:
            del t[k]

    _refused(
        tmp_path,
        f"{' and '.join(gone)} missing with draft_vocab_size 32 < vocab_size 50",
        recipe={"draft_vocab_size": 32},
        tensors_edit=edit,
    )


def test_lm_head_rows_refused(tmp_path):
    def edit(t):
        t["lm_head.weight"] = np.zeros((50, 16), np.float32)

    _refused(
        tmp_path,
        "lm_head.weight has 50 rows, draft_vocab_size is 32",
        recipe={"draft_vocab_size": 32},
        tensors_edit=edit,
    )


@pytest.mark.parametrize("flag", ["attention_bias", "mlp_bias"])
def test_bias_flag_refused(tmp_path, flag):
    # a target with biases: Automodel's draft builds them too
    _refused(tmp_path, f"{flag}: true is refused: SGLang .* ignores them silently", target_edit={flag: True})


def test_bias_tensor_refused(tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.q_proj.bias"] = np.zeros(16, np.float32)

    _refused(tmp_path, "1 bias tensors: model.layers.0.self_attn.q_proj.bias: SGLang", tensors_edit=edit)


def test_key_without_parameter_and_parameter_without_key(tmp_path):
    def edit(t):
        del t["model.norm.weight"]
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.zeros(2, np.float32)

    _refused(
        tmp_path,
        "1 missing: model.norm.weight; 1 unexpected: model.layers.0.self_attn.rotary_emb.inv_freq",
        tensors_edit=edit,
    )


def test_fc_norm_without_flag_is_unexpected(tmp_path):
    def edit(t):
        for i in range(3):
            t[f"model.fc_norm.{i}.weight"] = np.ones(16, np.float32)

    _refused(tmp_path, "3 unexpected: model.fc_norm.0.weight", tensors_edit=edit)


def test_fc_norm_flag_without_tensors_is_missing(tmp_path):
    def edit(t):
        del t["model.fc_norm.2.weight"]

    _refused(tmp_path, "1 missing: model.fc_norm.2.weight", recipe={"fc_norm": True}, tensors_edit=edit)


def test_fc_shape_mismatch(tmp_path):
    def edit(t):
        t["model.fc.weight"] = np.zeros((16, 32), np.float32)

    _refused(
        tmp_path,
        r"model.fc.weight has shape \[16, 32\], expected \[16, 48\] = \[H, A\*T\] from H = hidden_size, "
        r"A = aux hidden states \(num_aux_hidden_states, default 3\), T = target_hidden_size",
        tensors_edit=edit,
    )


def test_attention_shape_mismatch_names_head_keys(tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 32), np.float32)

    _refused(
        tmp_path,
        r"k_proj.weight has shape \[8, 32\], expected \[16, 32\] = \[nkv\*d, 2\*H\] from "
        r"nkv = num_key_value_heads, d = head_dim",
        target_edit={"num_key_value_heads": 2, "head_dim": 8},
        tensors_edit=edit,
    )


def test_draft_vocab_larger_than_vocab_refused(tmp_path):
    _refused(tmp_path, "draft_vocab_size 64 exceeds vocab_size 50", json_edit={"draft_vocab_size": 64})


def test_vocab_map_dtype_refused(tmp_path):
    def edit(t):
        t["d2t"] = t["d2t"].astype(np.int32)

    _refused(tmp_path, "d2t is I32; expected I64", recipe={"draft_vocab_size": 32}, tensors_edit=edit)


def test_integer_weight_refused(tmp_path):
    def edit(t):
        t["model.norm.weight"] = np.zeros(16, np.int32)

    _refused(tmp_path, "model.norm.weight is I32", tensors_edit=edit)


def test_target_hidden_refused_for_speculators(tmp_path):
    _refused(
        tmp_path,
        "target_hidden_size 24 differs from hidden_size 16: speculators 0.9.0 builds fc",
        plan="eagle3-speculators",
        draft_edit={"target_hidden_size": 24},
    )


def test_other_rules_refused(tmp_path):
    src, _, _ = make_draft(tmp_path / "step")
    with pytest.raises(PlanError, match="cannot be combined with strip_prefix"):
        rewrite(src, tmp_path / "out", plan="eagle3", rules=[{"strip_prefix": "model."}])


def test_verifier_required_and_refused_elsewhere(tmp_path):
    src, _, _ = make_draft(tmp_path / "step")
    with pytest.raises(UsageError, match="needs verifier ORG/NAME"):  # the library's name (#49)
        rewrite(src, tmp_path / "out", plan="eagle3-speculators")
    for plan in ("eagle3", "eagle4"):
        with pytest.raises(UsageError, match="^verifier applies to plan eagle3-speculators only"):
            rewrite(src, tmp_path / "out", plan=plan, verifier=VERIFIER)
    assert not (tmp_path / "out").exists()


def _cli(*a):
    return subprocess.run([sys.executable, "-m", "streamck", "rewrite", *map(str, a)], capture_output=True, text=True)


def _errors(stderr: str) -> list[str]:
    """stderr less the plan's notes (the aux layer ids' source comes before a later refusal)."""
    return [line for line in stderr.splitlines() if not line.startswith("streamck: note: ")]


def test_cli_exports_and_refusals(tmp_path):
    src, _, _ = make_draft(tmp_path / "step", {"draft_vocab_size": 32})
    dry = _cli(src, "--plan", "eagle3", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "EAGLE-3 draft for vLLM 0.33" in dry.stdout and "H=16, T=16, A=3" in dry.stdout
    assert "draft_V=32" in dry.stdout and "target_layers=32" in dry.stdout
    assert '"LlamaForCausalLMEagle3"' in dry.stdout and "model.fc.weight" in dry.stdout
    ok = _cli(src, "-o", tmp_path / "x", "--plan", "eagle3-speculators", "--verifier", VERIFIER, "-q")
    assert ok.returncode == 0, ok.stderr
    assert sorted(p.name for p in (tmp_path / "x").iterdir()) == ["config.json", "model.safetensors"]
    for args, message in (
        (("--plan", "eagle3-speculators"), "needs --verifier ORG/NAME"),
        (("--plan", "eagle3", "--verifier", VERIFIER), "--verifier applies to --plan eagle3-speculators"),
        (("--plan", "eagle4", "--verifier", VERIFIER), "--verifier applies to --plan eagle3-speculators"),
        (("--verifier", VERIFIER), "--verifier applies to --plan eagle3-speculators"),
        (("--plan", "eagle3", "--max-shard-size", "1KB"), "exactly one model.safetensors"),
    ):
        bad = _cli(src, "-o", tmp_path / "y", *args)
        assert bad.returncode == 2, (args, bad.stderr)
        assert message in bad.stderr and len(_errors(bad.stderr)) == 1, (args, bad.stderr)
        assert not (tmp_path / "y").exists()
    refused = make_draft(tmp_path / "peagle", draft_edit={"parallel_drafting": True})[0]
    bad = _cli(refused, "-o", tmp_path / "y", "--plan", "eagle3")
    assert bad.returncode == 2 and "P-EAGLE" in bad.stderr and bad.stderr.count("\n") == 1
    assert not (tmp_path / "y").exists()


def test_without_the_plan_a_note_names_it(tmp_path):
    """Issue #36: an Automodel EAGLE-3 draft step rewritten or listed without --plan names the
    plans (native and speculators); an EAGLE-3 export names none."""
    src, _, _ = make_draft(tmp_path / "step")
    says_the_plan(src, "eagle3")
    assert "--plan eagle3-speculators" in cli("ls", src, check=0).stdout.splitlines()[-1]
    rewrite(src, tmp_path / "native", plan="eagle3")
    assert not cli("ls", tmp_path / "native", check=0).stdout.splitlines()[-1].startswith("this looks like")
