"""The one-call library API: its docstring examples run, and it mirrors the CLI."""

import doctest
import signal
import threading

import pytest
from helpers import llama_like, save_sharded

import streamck
import streamck.api


def test_every_public_name_resolves_to_its_module_s_object():
    import importlib

    for name in streamck.__all__:
        assert getattr(streamck, name) is getattr(importlib.import_module(streamck._MODULE[name]), name), name
    assert set(dir(streamck)) >= set(streamck.__all__)
    with pytest.raises(AttributeError, match="no_such_name"):
        streamck.no_such_name  # noqa: B018


def test_the_type_stub_lists_the_same_names_from_the_same_modules():
    import ast
    from pathlib import Path

    stub = ast.parse((Path(streamck.__file__).parent / "__init__.pyi").read_text())
    listed = {a.asname: n.module for n in stub.body if isinstance(n, ast.ImportFrom) for a in n.names}
    assert listed == streamck._MODULE


def test_every_builtin_plan_is_public():
    """Each ``--plan`` name's function is a public name of the package, the same object."""
    from streamck.plan import BUILTIN_PLANS, PLAN_FUNCTIONS

    for name, (_, function) in PLAN_FUNCTIONS.items():
        assert function in streamck.__all__, function
        assert getattr(streamck, function) is BUILTIN_PLANS[name], name


def test_docstring_examples_run():
    failed, tried = doctest.testmod(streamck.api, optionflags=doctest.ELLIPSIS)
    assert tried >= 8 and failed == 0


def test_rewrite_mirrors_the_cli(tmp_path):
    src = save_sharded(tmp_path / "src", llama_like(), 2)
    result = streamck.rewrite(
        src,
        tmp_path / "out",
        rules=[{"strip_prefix": "model."}, streamck.Rule("drop", "*.inv_freq")],
        dtype="bf16",
        casts={"*norm.weight": "float32"},
        max_shard_size="500B",
        verify=True,
    )
    assert len(result.files) > 2
    got = streamck.ls(tmp_path / "out")["tensors"]
    assert "embed_tokens.weight" in got and not any(k.endswith("inv_freq") for k in got)
    assert got["norm.weight"]["dtype"] == "F32" and got["embed_tokens.weight"]["dtype"] == "BF16"
    assert streamck.diff(tmp_path / "out", tmp_path / "out", data=True).equal


def test_rewrite_from_a_worker_thread_leaves_signal_handlers_alone(tmp_path):
    src = save_sharded(tmp_path / "src", llama_like(), 1)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    seen, errors = [], []

    def work():
        try:
            streamck.rewrite(src, tmp_path / "out")
            seen.extend(signal.getsignal(s) for s in before)
        except BaseException as e:  # reported below, with its type
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert errors == []
    assert seen == list(before.values())
    assert {s: signal.getsignal(s) for s in before} == before
