"""Rules, their order, and the plan compiler's refusals."""

import numpy as np
import pytest
from helpers import llama_like, save

from streamck import PlanError, Rule, Rules, compile_plan, load_rules, open_checkpoint


def names(rules, src_names):
    return {n: rules.output_name(n) for n in src_names}


def test_each_rule():
    r = Rules((Rule("strip_prefix", "model."),))
    assert r.output_name("model.a") == "a" and r.output_name("lm_head") == "lm_head"
    assert Rules((Rule("add_prefix", "x."),)).output_name("a") == "x.a"
    assert Rules((Rule("rename", r"layers\.(\d+)\.=h.\1."),)).output_name("layers.3.w") == "h.3.w"
    assert Rules((Rule("drop", "*.inv_freq"),)).output_name("a.inv_freq") is None
    keep = Rules((Rule("keep", "model.*"),))
    assert keep.output_name("model.a") == "model.a" and keep.output_name("lm_head") is None


def test_rules_apply_in_the_order_given():
    a = Rules((Rule("strip_prefix", "model."), Rule("add_prefix", "model.")))
    b = Rules((Rule("add_prefix", "model."), Rule("strip_prefix", "model.")))
    assert a.output_name("model.x") == "model.x"
    assert b.output_name("model.x") == "model.x"
    c = Rules((Rule("rename", "^a=b"), Rule("rename", "^b=c")))
    d = Rules((Rule("rename", "^b=c"), Rule("rename", "^a=b")))
    assert c.output_name("a") == "c" and d.output_name("a") == "b"


def test_filters_match_the_source_name():
    r = Rules((Rule("strip_prefix", "model."), Rule("drop", "model.norm*")))
    assert r.output_name("model.norm.weight") is None


@pytest.mark.parametrize(
    ("kind", "arg"),
    [
        ("rename", "([a-z=x"),
        ("rename", "a=\\2"),
        ("rename", "noequals"),
        ("drop", "[z-a]"),
        ("cast", "*=int8"),
        ("bogus", "x"),
    ],
)
def test_invalid_rules(kind, arg):
    with pytest.raises(PlanError):
        Rule(kind, arg)


def test_collisions_are_listed(tmp_path):
    ckpt = open_checkpoint(save(tmp_path / "m.safetensors", {"model.a": np.zeros(1), "a": np.zeros(1)}))
    with pytest.raises(PlanError, match=r"1 output names collide: a, model.a -> a"):
        compile_plan(ckpt, Rules((Rule("strip_prefix", "model."),)))


def test_empty_result(tmp_path):
    ckpt = open_checkpoint(save(tmp_path / "m.safetensors", {"a": np.zeros(1)}))
    with pytest.raises(PlanError, match="leave no tensor"):
        compile_plan(ckpt, Rules((Rule("keep", "zzz*"),)))


def test_plan_is_sorted_and_carries_metadata(tmp_path):
    ckpt = open_checkpoint(save(tmp_path / "m.safetensors", llama_like(), metadata={"k": "v"}))
    plan = compile_plan(ckpt, Rules((Rule("drop", "*inv_freq"),)))
    assert [t.name for t in plan.tensors] == sorted(t.name for t in plan.tensors)
    assert plan.metadata == {"k": "v", "format": "pt"}
    assert not any(t.name.endswith("inv_freq") for t in plan.tensors)


def test_toml_plan_file(tmp_path):
    path = tmp_path / "plan.toml"
    path.write_text(
        'dtype = "bf16"\nrules = [{strip_prefix = "model."}, {rename = "^(.*)\\\\.weight$=\\\\1.w"},'
        ' {drop = "*.inv_freq"}, {cast = "*norm*=fp32"}]\n'
    )
    rules = load_rules(path)
    assert rules.dtype == "BF16"
    assert rules.output_name("model.x.weight") == "x.w"
    assert rules.output_name("model.r.inv_freq") is None
    assert rules.cast_for("model.norm.weight") == "F32"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("rules = [", "not valid TOML"),
        ("rules = [{drop = 1}]", "string"),
        ("rules = [{rename = '(=x'}]", "rules\\[0\\]"),
        ("colour = 1", "unknown top-level"),
    ],
)
def test_bad_plan_files(tmp_path, text, message):
    path = tmp_path / "plan.toml"
    path.write_text(text)
    with pytest.raises(PlanError, match=message) as e:
        load_rules(path)
    assert str(path) in str(e.value)
