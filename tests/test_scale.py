"""Issue #44: a checkpoint of many small tensors moves in few system calls: consecutive
tensors whose bytes continue one another in the source and in the output are one copy,
whatever the rename. Counted (calls, not seconds)."""

from __future__ import annotations

import os

import numpy as np
from helpers import read_all, save

from streamck import Rules, compile_plan, open_checkpoint, write_plan
from streamck.plan.rules import rules_from


def _many(tmp_path, count=3000):
    tensors = {f"model.layers.{i // 10}.t{i % 10}": np.full(16, i, np.float32) for i in range(count)}
    return save(tmp_path / "src.safetensors", tensors), tensors


def _writes(monkeypatch) -> list[int]:
    """The sizes of every os.write, os.pwrite and os.copy_file_range the writer makes."""
    calls: list[int] = []
    for name in ("write", "pwrite", "copy_file_range"):
        real = getattr(os, name)

        def counted(*args, _real=real):
            n = _real(*args)
            calls.append(n)
            return n

        monkeypatch.setattr(os, name, counted)
    return calls


def test_a_renamed_copy_of_many_tensors_is_a_few_calls(tmp_path, monkeypatch):
    src, tensors = _many(tmp_path)
    plan = compile_plan(open_checkpoint(src), Rules(rules_from([{"strip_prefix": "model."}])))
    calls = _writes(monkeypatch)
    write_plan(plan, tmp_path / "out.safetensors")
    monkeypatch.undo()
    assert len(calls) <= 8, len(calls)  # the header and one run: was one write per tensor (3000+)
    got = read_all(tmp_path / "out.safetensors")
    assert sorted(got) == sorted(n.removeprefix("model.") for n in tensors)
    assert all(np.array_equal(got[n.removeprefix("model.")], v) for n, v in tensors.items())


def test_a_stream_of_many_tensors_is_a_few_calls(tmp_path, monkeypatch):
    src, tensors = _many(tmp_path)
    plan = compile_plan(open_checkpoint(src), Rules())
    out = os.open(tmp_path / "out.safetensors", os.O_WRONLY | os.O_CREAT, 0o644)
    monkeypatch.setattr("sys.stdout", os.fdopen(out, "w"))
    calls = _writes(monkeypatch)
    write_plan(plan, "-")
    monkeypatch.undo()
    assert len(calls) <= 8, len(calls)
    got = read_all(tmp_path / "out.safetensors")
    assert all(np.array_equal(got[n], v) for n, v in tensors.items())


def test_each_output_tensor_size_is_computed_once(tmp_path, monkeypatch):
    """OutputTensor.nbytes was recomputed ~6 times per tensor (layout, header, totals, progress)."""
    import streamck.plan.compile as compile_module

    src, tensors = _many(tmp_path)
    calls = []
    real = compile_module.nbytes
    monkeypatch.setattr(compile_module, "nbytes", lambda *a: calls.append(1) or real(*a))
    plan = compile_plan(open_checkpoint(src), Rules(rules_from([{"strip_prefix": "model."}])))
    write_plan(plan, tmp_path / "out.safetensors", verify=True)
    assert len(calls) == len(tensors)


def test_ls_takes_each_file_path_once(tmp_path, monkeypatch, capsys):
    """``ls`` spent half its time in one os.path.relpath per tensor: one per file now."""
    from streamck.cli import main

    src, tensors = _many(tmp_path)
    calls = []
    real = os.path.relpath
    monkeypatch.setattr(os.path, "relpath", lambda *a: calls.append(1) or real(*a))
    assert main(["ls", str(src)]) == 0
    assert len(calls) <= 2 and f"{len(tensors)} tensors in 1 file(s)" in capsys.readouterr().out
