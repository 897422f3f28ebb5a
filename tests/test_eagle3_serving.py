"""--plan eagle3 and --plan eagle3-speculators served right: the aux layer ids each engine
reads, by its own rule (eagle3_drafts.AUX_READERS, written down with the engine version and
file), are the layers the draft was trained on; the ids come from the step's recipe snapshot,
Automodel's default or the caller, and the source is said; the served config is one that
transformers 5's LlamaConfig (through which vLLM 0.33 and SGLang 0.5.23 read it) builds a
one-layer Llama from; norm_before_fc and other aux counts are served."""

import json
import subprocess
import sys

import numpy as np
import pytest
from eagle3_drafts import (
    captured_layers,
    engine_load,
    engine_params,
    engine_shape,
    make_draft,
    serving_name,
    speculators_as_vllm,
)
from helpers import read_all

from streamck import PlanError, UsageError
from streamck.api import build_plan, rewrite

VERIFIER = "meta-llama/Llama-3.1-8B-Instruct"
# Draft steps and the ids they were trained on (None: the recipe's default, which Automodel's
# own default_eagle3_aux_layer_ids gives for the target's depth).
CASES = {
    "llama_default": ({"target": "llama3.1"}, None),
    "llama_custom": ({"target": "llama3.1", "recipe": {"aux_layer_ids": [4, 12, 30]}}, [4, 12, 30]),
    "qwen3_default": ({"target": "qwen3", "recipe": {"draft_vocab_size": 32}}, None),
    "qwen3_custom": ({"target": "qwen3", "recipe": {"aux_layer_ids": [0, 20, 34], "fc_norm": True}}, [0, 20, 34]),
}


def trained_ids(config: dict, ids: list[int] | None) -> list[int]:
    from nemo_automodel.components.speculative.eagle.target import default_eagle3_aux_layer_ids

    return ids if ids is not None else default_eagle3_aux_layer_ids(config["num_hidden_layers"])


def served(tmp_path, plan="eagle3", name="out", src=None, **kw) -> dict:
    extra = {"verifier": VERIFIER} if plan == "eagle3-speculators" else {}
    rewrite(src, tmp_path / name, plan=plan, **extra, **kw)
    return json.loads((tmp_path / name / "config.json").read_text())


# ---- 1. the ids each engine reads are the trained layers -------------------------------------


@pytest.mark.parametrize("engine", ["vllm", "vllm_v2", "sglang"])
@pytest.mark.parametrize("case", CASES)
def test_engines_capture_the_trained_layers(tmp_path, case, engine):
    kw, ids = CASES[case]
    src, config, _ = make_draft(tmp_path / "step", **kw)
    body = served(tmp_path, src=src)
    n = config["num_hidden_layers"]
    assert captured_layers(body, engine, n) == trained_ids(config, ids)
    # written out even for the default: both keys, whatever the engines' defaults become
    assert body["eagle_aux_hidden_state_layer_ids"] and body["eagle_config"]["eagle_aux_hidden_state_layer_ids"]


@pytest.mark.parametrize("case", CASES)
def test_speculators_ids_are_the_trained_layers(tmp_path, case):
    from speculators.models.utils import resolve_target_layer_ids

    kw, ids = CASES[case]
    src, config, _ = make_draft(tmp_path / "step", **kw)
    body = served(tmp_path, "eagle3-speculators", src=src)
    want = trained_ids(config, ids)
    assert captured_layers(body, "vllm_speculators", config["num_hidden_layers"]) == want
    # speculators' own check of explicit ids against the verifier (here the target's config)
    target = tmp_path / "step-target"
    assert resolve_target_layer_ids(body["eagle_aux_hidden_state_layer_ids"], str(target)) == [k + 1 for k in want]


def test_last_layer_served_by_vllm_only(tmp_path):
    """vLLM records the last layer's output (id n); SGLang captures k's output at layer k + 1's input."""
    src, _, _ = make_draft(tmp_path / "step", {"aux_layer_ids": [1, 15, 31]})
    body = served(tmp_path, "eagle3-speculators", src=src)
    assert captured_layers(body, "vllm_speculators", 32) == [1, 15, 31]
    with pytest.raises(PlanError, match=r"aux layer id 31 .* outside 0 .. 30 .*: SGLang 0.5.23 captures"):
        served(tmp_path, src=src, name="native")
    assert not (tmp_path / "native").exists()


# ---- 2. where the ids come from, said; refused when impossible -------------------------------


def test_ids_from_snapshot_when_given_the_consolidated_dir(tmp_path):
    src, _, _ = make_draft(tmp_path / "step", {"aux_layer_ids": [3, 9, 27]})
    plan = build_plan(src / "model" / "consolidated", plan="eagle3")
    body = json.loads(plan.files["config.json"])
    assert captured_layers(body, "sglang", 32) == captured_layers(body, "vllm", 32) == [3, 9, 27]
    [note, _] = plan.notices  # and the float32 weights' note (tests/test_vllm.py)
    assert "[3, 9, 27]" in note and f"from recipe_args.aux_layer_ids in {src / 'config.yaml'}" in note
    assert note in plan.summary


@pytest.mark.parametrize("snapshot", [True, False])
def test_default_ids_said(tmp_path, snapshot):
    src, _, _ = make_draft(tmp_path / "step", target="qwen3", snapshot=snapshot)
    plan = build_plan(src, plan="eagle3")
    [note, _] = plan.notices  # and the float32 weights' note (tests/test_vllm.py)
    assert "[1, 17, 32]" in note and "Automodel's default [1, n//2 - 1, n - 4] for n = 36" in note
    assert ("sets no recipe_args.aux_layer_ids" if snapshot else "no config.yaml") in note


@pytest.mark.parametrize("given", [[2, 9, 20], "2,9,20", (2, 9, 20)])
def test_override_wins(tmp_path, given):
    src, _, _ = make_draft(tmp_path / "step", {"aux_layer_ids": [3, 9, 27]})
    for plan in ("eagle3", "eagle3-speculators"):
        extra = {"verifier": VERIFIER} if plan == "eagle3-speculators" else {}
        built = build_plan(src, plan=plan, aux_layer_ids=given, **extra)
        body = json.loads(built.files["config.json"])
        engine = "vllm" if plan == "eagle3" else "vllm_speculators"
        assert captured_layers(body, engine, 32) == [2, 9, 20]
        assert "from --aux-layer-ids" in built.notices[0]


def test_ids_from_config_json_taken_back(tmp_path):
    """A config.json holding ids (Automodel writes none) is read in each key's convention."""
    top = {"eagle_aux_hidden_state_layer_ids": [2, 16, 29]}
    src, _, _ = make_draft(tmp_path / "a", json_edit=top, snapshot=False)
    assert captured_layers(served(tmp_path, src=src, name="a-out"), "sglang", 32) == [1, 15, 28]
    inner = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}}
    src, _, _ = make_draft(tmp_path / "b", json_edit=inner, snapshot=False)
    assert captured_layers(served(tmp_path, src=src, name="b-out"), "vllm", 32) == [1, 15, 28]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (
            {"recipe": {"aux_layer_ids": [1, 15, 32]}},
            r"config.yaml: aux layer id 32 from recipe_args.aux_layer_ids is outside 0 .. 3[01] for a",
        ),
        ({"recipe": {"aux_layer_ids": [1, 15, 15]}}, r"aux layer ids \[1, 15, 15\] from recipe_args.* repeat a layer"),
        ({"recipe": {"aux_layer_ids": [1, 15]}}, r"2 aux layer ids \[1, 15\] from .*: the draft's fc takes 3"),
        ({"recipe": {"aux_layer_ids": "1,15,28"}}, "recipe_args.aux_layer_ids must be a list of layer numbers"),
        (
            {"recipe": {"aux_layer_ids": [1, 15, 28]}, "json_edit": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}},
            r"eagle_aux_hidden_state_layer_ids less 1 \[0, 14, 27\] disagree with .*config.yaml",
        ),
        ({"target_edit": {"num_hidden_layers": 4}}, r"aux layer ids \[1, 1, 0\] from Automodel's default"),
        (
            {
                "snapshot": False,
                "json_edit": {
                    "eagle_aux_hidden_state_layer_ids": [1, 15, 28],
                    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]},
                },
            },
            r"config.json: eagle_config.eagle_aux_hidden_state_layer_ids \[1, 15, 28\] and "
            r"eagle_aux_hidden_state_layer_ids less 1 \[0, 14, 27\] disagree",
        ),
    ],
)
def test_impossible_ids_refused(tmp_path, kw, match):
    src, _, _ = make_draft(tmp_path / "step", **kw)
    for plan in ("eagle3", "eagle3-speculators"):
        with pytest.raises(PlanError, match=match):
            served(tmp_path, plan, src=src)
        assert not (tmp_path / "out").exists()


def test_override_refused(tmp_path):
    src, _, _ = make_draft(tmp_path / "step")
    with pytest.raises(UsageError, match="^aux_layer_ids takes target layer numbers like 1,15,28, not 'a,b'$"):
        rewrite(src, tmp_path / "out", plan="eagle3", aux_layer_ids="a,b")
    with pytest.raises(PlanError, match=r"4 aux layer ids \[1, 2, 3, 4\] from aux_layer_ids: the draft's fc takes 3"):
        rewrite(src, tmp_path / "out", plan="eagle3", aux_layer_ids=[1, 2, 3, 4])
    for plan in ("eagle4", None):
        with pytest.raises(UsageError, match="aux_layer_ids applies to plan eagle3, eagle3-speculators only"):
            rewrite(src, tmp_path / "out", plan=plan, aux_layer_ids=[1, 2, 3])
    assert not (tmp_path / "out").exists()


def _cli(*a):
    return subprocess.run([sys.executable, "-m", "streamck", "rewrite", *map(str, a)], capture_output=True, text=True)


def test_cli_aux_layer_ids(tmp_path):
    src, _, _ = make_draft(tmp_path / "step", {"aux_layer_ids": [3, 9, 27]})
    dry = _cli(src, "--plan", "eagle3", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "aux layers [3, 9, 27] (outputs of target layers) from " in dry.stdout
    assert "SGLang's eagle_config.eagle_aux_hidden_state_layer_ids [3, 9, 27]" in dry.stdout
    assert "vLLM's eagle_aux_hidden_state_layer_ids [4, 10, 28]" in dry.stdout
    ok = _cli(src, "-o", tmp_path / "x", "--plan", "eagle3", "--aux-layer-ids", "2,9,20")
    assert ok.returncode == 0, ok.stderr
    assert "streamck: note: aux layers [2, 9, 20] (outputs of target layers) from --aux-layer-ids" in ok.stderr
    body = json.loads((tmp_path / "x" / "config.json").read_text())
    assert captured_layers(body, "sglang", 32) == [2, 9, 20]
    for args, message in (
        (("--plan", "eagle3", "--aux-layer-ids", "1,x,3"), "--aux-layer-ids takes target layer numbers"),
        (("--plan", "eagle3", "--aux-layer-ids", "1,15,31"), "SGLang 0.5.23 captures layer k's output"),
        (("--plan", "eagle4", "--aux-layer-ids", "1,15,28"), "--aux-layer-ids applies to --plan eagle3"),
    ):
        bad = _cli(src, "-o", tmp_path / "y", *args)
        assert bad.returncode == 2, (args, bad.stderr)
        assert message in bad.stderr and bad.stderr.count("\n") == 1, (args, bad.stderr)
        assert "Traceback" not in bad.stderr and not (tmp_path / "y").exists()


# ---- 3. a transformers-5 config both engines build a one-layer Llama draft from ----------------


@pytest.mark.parametrize("plan", ["eagle3", "eagle3-speculators"])
@pytest.mark.parametrize("target", ["llama3.1", "qwen3"])
def test_served_config_is_a_one_layer_llama(tmp_path, target, plan):
    import torch
    from transformers import AutoConfig, LlamaConfig

    src, config, _ = make_draft(tmp_path / "step", target=target)
    body = served(tmp_path, plan, src=src)
    layer = body if plan == "eagle3" else body["transformer_layer_config"]
    assert config["model_type"] == target.removesuffix("3.1") and layer["model_type"] == "llama"
    # transformers 5.19 (SGLang 0.5.23 pins it; vLLM 0.33 reads through the same classes)
    llama = LlamaConfig.from_dict(layer)
    assert llama.num_hidden_layers == 1 and llama.layer_types == ["full_attention"]
    want = AutoConfig.from_pretrained(tmp_path / "step-target")  # the target as the recipe read it
    assert llama.rope_parameters == want.rope_parameters
    # SGLang's LlamaDecoderLayer: rope_theta = rope_parameters.get("rope_theta", 10000)
    assert layer["rope_parameters"]["rope_theta"] == want.rope_parameters["rope_theta"]
    assert llama.dtype == want.dtype == torch.bfloat16 and "torch_dtype" not in json.dumps(body)
    assert llama.head_dim == config["head_dim"]


def test_transformers4_draft_config(tmp_path):
    """A draft config in transformers 4's form: rope_theta/rope_scaling and torch_dtype become
    what LlamaConfig makes of them."""
    from transformers import LlamaConfig

    legacy = {
        "rope_parameters": None,
        "rope_theta": 500000.0,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "type": "llama3"},
        "dtype": None,
        "torch_dtype": "float16",
        "max_position_embeddings": 8192,
    }
    src, config, _ = make_draft(tmp_path / "step", json_edit=legacy)
    body = served(tmp_path, src=src)
    assert "rope_theta" not in body and "rope_scaling" not in body and body["dtype"] == "float16"
    assert LlamaConfig.from_dict(body).rope_parameters == LlamaConfig.from_dict(config).rope_parameters


# ---- 4. norm_before_fc and other aux counts ----------------------------------------------


def _input_norm(t):
    t["model.input_norm.weight"] = np.linspace(0.5, 1.5, 48, dtype=np.float32)


def _speculators_load(out, tensors):
    import torch
    from safetensors.torch import load_file
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    body = json.loads((out / "config.json").read_text())
    model = Eagle3DraftModel(Eagle3SpeculatorConfig.model_validate(body))
    exported = load_file(out / "model.safetensors")
    own = model.state_dict()
    model.load_state_dict(exported | {k: own[k] for k in model._keys_to_ignore_on_save}, strict=True)
    for train, arr in tensors.items():
        assert torch.equal(model.state_dict()[serving_name(train)], torch.from_numpy(arr)), train
    return body


def _engines_take_every_key(body: dict, out, engine: str) -> None:
    keys = {k: tuple(v.shape) for k, v in read_all(out / "model.safetensors").items()}
    params = engine_params(body, engine)
    assert {engine_load(k, engine) for k in keys} - {None} == set(params)
    for param, shape in params.items():
        assert engine_shape(keys, param) == shape, param


def test_norm_before_fc_served(tmp_path):
    src, _, tensors = make_draft(tmp_path / "step", draft_edit={"norm_before_fc": True}, tensors_edit=_input_norm)
    body = served(tmp_path, src=src)
    assert body["norm_before_fc"] is True
    for engine in ("vllm", "sglang"):
        _engines_take_every_key(body, tmp_path / "out", engine)
    assert read_all(tmp_path / "out" / "model.safetensors")["input_norm.weight"].tolist() == (
        tensors["model.input_norm.weight"].tolist()
    )
    served(tmp_path, "eagle3-speculators", name="spec", src=src)
    body = _speculators_load(tmp_path / "spec", tensors)
    _engines_take_every_key(speculators_as_vllm(body), tmp_path / "spec", "vllm")


def test_norm_before_fc_needs_its_norm(tmp_path):
    src, _, _ = make_draft(tmp_path / "step", draft_edit={"norm_before_fc": True})
    with pytest.raises(PlanError, match="1 missing: model.input_norm.weight"):
        served(tmp_path, src=src)


def test_norm_before_fc_with_fc_norm_native_only(tmp_path):
    src, _, _ = make_draft(
        tmp_path / "step", {"fc_norm": True}, draft_edit={"norm_before_fc": True}, tensors_edit=_input_norm
    )
    body = served(tmp_path, src=src)
    _engines_take_every_key(body, tmp_path / "out", "sglang")
    with pytest.raises(PlanError, match="norm_before_fc and fc_norm are both true: speculators 0.9.0 takes one"):
        served(tmp_path, "eagle3-speculators", name="spec", src=src)


def test_four_aux_states(tmp_path):
    """Automodel's draft sizes fc from num_aux_hidden_states; the engines from the ids' count."""
    ids = [1, 8, 15, 28]
    src, _, tensors = make_draft(
        tmp_path / "step", {"aux_layer_ids": ids, "fc_norm": True}, draft_edit={"num_aux_hidden_states": 4}
    )
    assert tensors["model.fc.weight"].shape == (16, 64) and "model.fc_norm.3.weight" in tensors
    body = served(tmp_path, src=src)
    for engine in ("vllm", "sglang"):
        assert captured_layers(body, engine, 32) == ids
        _engines_take_every_key(body, tmp_path / "out", engine)
        _engines_take_every_key(
            {k: v for k, v in body.items() if k != "num_aux_hidden_states"}, tmp_path / "out", engine
        )
    served(tmp_path, "eagle3-speculators", name="spec", src=src)
    spec = _speculators_load(tmp_path / "spec", tensors)
    _engines_take_every_key(speculators_as_vllm(spec), tmp_path / "spec", "vllm")
    with pytest.raises(PlanError, match=r"3 aux layer ids \[1, 15, 28\] from aux_layer_ids: the draft's fc takes 4"):
        served(tmp_path, src=src, name="bad", aux_layer_ids=[1, 15, 28])
