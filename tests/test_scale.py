"""Issue #44: a checkpoint of many small tensors moves in few system calls: consecutive
tensors whose bytes continue one another in the source and in the output are one copy,
whatever the rename. Counted (calls, not seconds)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
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


class _Name(str):
    """A tensor name that counts every prefix test, slice and ordering comparison made of it
    (the work of finding what lies under a block), in ``_Name.ops``."""

    ops = 0

    def __lt__(self, other):
        _Name.ops += 1
        return super().__lt__(other)

    def startswith(self, *args):
        _Name.ops += 1
        return super().startswith(*args)

    def __getitem__(self, key):
        _Name.ops += 1
        return super().__getitem__(key)


def _moe(root, layers: int, experts: int = 8, fused: bool = False):
    """A DeepSeek-V3-like checkpoint (config.json beside it) of ``layers`` MoE layers at tiny
    shapes: per-expert projections with their scales, or fused runtime experts."""
    import json

    h, i = 4, 2
    t = {"model.embed_tokens.weight": np.zeros((8, h), np.float32)}
    for n in range(layers):
        pre = f"model.layers.{n}.mlp"
        t[f"{pre}.gate.weight"] = np.zeros((experts, h), np.float32)
        t[f"{pre}.shared_experts.up_proj.weight"] = np.zeros((i, h), np.float32)
        if fused:
            t[f"{pre}.experts.gate_up_proj"] = np.zeros((experts, 2 * i, h), np.float32)
            t[f"{pre}.experts.down_proj"] = np.zeros((experts, h, i), np.float32)
            continue
        for e in range(experts):
            for p, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
                t[f"{pre}.experts.{e}.{p}.weight"] = np.zeros(shape, np.float32)
                t[f"{pre}.experts.{e}.{p}.weight_scale_inv"] = np.ones((1, 1), np.float32)
    save(root / "model.safetensors", t)
    (root / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "n_routed_experts": experts}))
    return root


def _moe_ops(tmp_path, layers: int, fused: bool) -> tuple[int, int]:
    """(name operations apply_experts makes, tensors) on a ``_moe`` checkpoint of ``layers`` layers."""
    from dataclasses import replace

    from streamck.plan.moe import apply_experts

    root = _moe(tmp_path / f"{layers}-{fused}", layers, fused=fused)
    plan = compile_plan(open_checkpoint(root), Rules())
    plan.tensors = [replace(t, name=_Name(t.name)) for t in plan.tensors]
    _Name.ops = 0
    out = apply_experts(plan, "auto")
    assert any(".experts.7.down_proj.weight" in t.name for t in out.tensors)
    return _Name.ops, len(plan.tensors)


@pytest.mark.parametrize("fused", [False, True])
def test_moe_blocks_are_indexed_once_not_scanned_per_layer(tmp_path, fused):
    """plan/moe tested every tensor's name against every MoE block (a dict comprehension per
    layer: 39% of a DeepSeek-V3 --dry-run, quadratic). With 8 times the layers the work per
    tensor was 8 times as much; a sort's log grows it by less than 2."""
    few, few_tensors = _moe_ops(tmp_path, 4, fused)
    many, many_tensors = _moe_ops(tmp_path, 32, fused)
    assert many / many_tensors <= 2 * few / few_tensors, (few, few_tensors, many, many_tensors)


class _Rules(tuple):
    """A rule list that counts how often it is walked (iterated, indexed, measured)."""

    walks = 0

    def __iter__(self):
        _Rules.walks += 1
        return super().__iter__()

    def __getitem__(self, i):
        _Rules.walks += 1
        return super().__getitem__(i)

    def __len__(self):
        _Rules.walks += 1
        return super().__len__()


def test_rules_are_sorted_out_once_not_walked_per_tensor(tmp_path):
    """output_name walked the rule list three times per tensor (keeps, drops, renames) and
    cast_for once more: ~0.5 s of a 92k-tensor --strip-prefix. Now once per Rules."""
    src, tensors = _many(tmp_path)
    rules = rules_from([{"strip_prefix": "model."}, {"drop": "*.t9"}, {"cast": "*.t1=bf16"}])
    _Rules.walks = 0
    plan = compile_plan(open_checkpoint(src), Rules(_Rules(rules)))
    assert _Rules.walks <= 10, _Rules.walks  # was 18,901: 6 per tensor
    assert len(plan.tensors) == len(tensors) * 9 // 10
    assert {t.dtype for t in plan.tensors if t.name.endswith(".t1")} == {"BF16"}
    assert all(not t.name.startswith("model.") for t in plan.tensors)


def _collections(run):
    """What ``run()`` returns, and the generation of each collection made while it ran."""
    import gc

    runs: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            runs.append(info["generation"])

    gc.callbacks.append(count)
    try:
        return run(), runs
    finally:
        gc.callbacks.remove(count)


def test_no_collector_pass_while_a_run_builds_its_tensors(tmp_path):
    """Indexing, planning and laying out make a few objects per tensor and no cycles; the
    collector's passes over them were a fifth of a 92k-tensor --strip-prefix. Counted: the
    collections while a 2,000-tensor plan is built and written (were 16, growing with it)."""

    from streamck.api import build_plan

    warm = _moe(tmp_path / "warm", 1)
    write_plan(build_plan(warm, rules=[{"strip_prefix": "model."}]), tmp_path / "warm-out")  # imports done
    src = _moe(tmp_path / "src", 40)

    def run():
        plan = build_plan(src, rules=[{"strip_prefix": "model."}])
        write_plan(plan, tmp_path / "out")
        return plan

    plan, runs = _collections(run)
    assert len(plan.tensors) == 2001
    assert len(runs) <= 4, runs


def test_headers_render_as_the_stdlib_renders_them():
    """Headers are rendered by orjson (a third of a 92k-tensor header's cost): byte for byte
    what json.dumps(separators=(",", ":"), ensure_ascii=False) wrote, odd names included;
    what orjson refuses (an integer past 64 bits) still goes through the stdlib."""
    import json
    import struct

    from streamck.source.header import encode_header

    names = ["plain", "tab\there", "ctl\x01\x1f\x7f", 'quote"back\\slash', "ünï\u2028cødé", "emoji\U0001f600"]
    entries = [(n, "F32", (2, 3), 24) for n in names] + [("huge", "U8", (1 << 64,), 1 << 64)]
    meta = {"format": "pt", "note": "\x00\n\u2028"}
    raw = encode_header(entries, meta)
    want, offset = {"__metadata__": meta}, 0
    for name, dtype, shape, size in entries:
        want[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(want, separators=(",", ":"), ensure_ascii=False).encode()
    assert raw[8:].rstrip(b" ") == text and struct.unpack("<Q", raw[:8])[0] == len(raw) - 8
    small = encode_header(entries[:-1], meta)
    del want["huge"]
    assert small[8:].rstrip(b" ") == json.dumps(want, separators=(",", ":"), ensure_ascii=False).encode()


def test_no_collector_pass_while_hash_builds_its_manifest(tmp_path):
    """``hash`` made a digest and a few dicts per tensor with the collector on: its time per
    tensor at 140k was 1.7x that at 9.4k (each pass over everything made so far). Counted:
    the collections while a 3,000-tensor checkpoint is hashed, before its files' digests."""

    from streamck.check.digest import hash_manifest

    src, _ = _many(tmp_path)
    hash_manifest(open_checkpoint(save(tmp_path / "warm.safetensors", {"a": np.ones(2, np.float32)})))  # imports
    checkpoint = open_checkpoint(src)
    manifest, runs = _collections(lambda: hash_manifest(checkpoint))
    assert runs == [] and len(manifest["tensors"]) == 3000, runs


def test_runs_are_joined_without_comparing_paths(tmp_path, monkeypatch):
    """The writer compared each tensor's source Path with the one before it (twice per tensor:
    laying out and writing), in Python: the refs of one file share one Path, so none is needed."""
    from pathlib import PurePath

    src, tensors = _many(tmp_path)
    plan = compile_plan(open_checkpoint(src), Rules(rules_from([{"strip_prefix": "model."}])))
    calls = []
    real = PurePath.__eq__
    monkeypatch.setattr(PurePath, "__eq__", lambda *a: calls.append(1) or real(*a))
    write_plan(plan, tmp_path / "out.safetensors")
    monkeypatch.undo()
    assert len(calls) <= 20, len(calls)  # was 2 per tensor
    assert len(read_all(tmp_path / "out.safetensors")) == len(tensors)


class _Names(dict):
    """Tensors by name that count how often all their names are walked."""

    walks = 0

    def __iter__(self):
        _Names.walks += 1
        return super().__iter__()


def test_the_producer_hint_looks_names_up_not_over():
    """plan_hint ran six fnmatch passes over every name for a checkpoint of no known producer;
    each producer's plain mark is looked up now, and a glob scans only after it is found."""
    from streamck.source.producers import plan_hint

    names = _Names.fromkeys(f"model.layers.{i}.mlp.experts.{i}.w.weight" for i in range(1000))
    _Names.walks = 0
    assert plan_hint(names) is None and _Names.walks == 0
    titan = _Names.fromkeys(["tok_embeddings.weight", "layers.0.attention.wq.weight", "norm.weight"])
    assert "torchtitan step (Llama" in plan_hint(titan)


def test_the_producer_hint_names_what_fnmatch_named():
    """Each producer's marks (globs filled in) hinted as the fnmatch passes hinted them."""
    import fnmatch

    from streamck.source.producers import PRODUCERS, plan_hint

    def by_fnmatch(names: list[str]) -> str | None:
        for who, advice, marks in PRODUCERS:
            if all(fnmatch.filter(names, mark) for mark in marks):
                return f"this looks like {who}: {advice}"
        return None

    for _, _, marks in PRODUCERS:
        names = [m.replace("*", "0.x") for m in marks] + ["model.norm.weight"]
        assert plan_hint(names) == by_fnmatch(names) is not None
        assert plan_hint(names[1:]) == by_fnmatch(names[1:])


def test_each_moe_block_is_made_once(monkeypatch):
    """find_blocks made a Block (and its dict of dicts) per expert tensor only to keep the first:
    ~92k of them for DeepSeek-V3's 58 blocks, a fifth of its ``ls``."""
    from streamck.plan.moe import blocks

    made = []
    real = blocks.Block
    monkeypatch.setattr(blocks, "Block", lambda *a: made.append(1) or real(*a))
    names = [f"model.layers.{i}.mlp.experts.{e}.{p}.weight" for i in range(4) for e in range(64) for p in "abc"]
    found = blocks.find_blocks([*names, "model.layers.4.mlp.experts.gate_up_proj"])
    assert len(found) == 5 and len(made) == 5, len(made)  # was one per tensor: 769
    assert len(found["model.layers.0.mlp"].experts["b"]) == 64


def test_a_header_is_rendered_without_a_dict_per_tensor():
    """encode_header built a dict and two lists per tensor before rendering: 50 MB at the peak
    of a 92k-tensor copy. Counted in bytes allocated at the peak (tracemalloc), per entry, less
    than four times the rendered header (was eight)."""
    import tracemalloc

    from streamck.source.header import encode_header

    entries = [
        (f"model.layers.{i // 100}.mlp.experts.{i % 100}.up_proj.weight", "BF16", (16, 16), 512) for i in range(20000)
    ]
    tracemalloc.start()
    raw = encode_header(iter(entries), {"format": "pt"})
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak / len(entries) < 4 * len(raw) / len(entries), (peak / len(entries), len(raw) / len(entries))


def test_hash_reads_neighbouring_small_tensors_together(tmp_path, monkeypatch, capsys):
    """``hash`` read every tensor with a call of its own: 92k reads for DeepSeek-V3's layout.
    Counted: the read calls for 3,000 small tensors; the digests are hashlib's of each."""
    import hashlib
    import json

    from streamck.check import tensor_digests

    src, tensors = _many(tmp_path)
    reads = []
    for name in ("preadv", "pread", "read", "readv"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda *a, _real=real: reads.append(1) or _real(*a))
    digests = tensor_digests(open_checkpoint(src))
    monkeypatch.undo()
    assert len(reads) <= 10, len(reads)  # was one per tensor
    assert list(digests) == list(open_checkpoint(src).tensors)
    assert all(digests[n] == hashlib.sha256(v.tobytes()).hexdigest() for n, v in tensors.items())
    from streamck.cli import main

    assert main(["hash", str(src), "--json"]) in (0, None)
    out = json.loads(capsys.readouterr().out)
    assert out["tensors"]["model.layers.7.t3"]["sha256"] == digests["model.layers.7.t3"]


def test_tables_render_each_shape_once(tmp_path, monkeypatch, capsys):
    """``ls`` and ``--dry-run`` rendered every row's shape (an eighth of a 92k listing); a
    checkpoint has a few shapes, each rendered once now."""
    import streamck.cli_show as show
    from streamck.cli import main

    src, tensors = _many(tmp_path)
    calls = []
    real = show.shape_str
    monkeypatch.setattr(show, "shape_str", lambda s: calls.append(s) or real(s))
    assert main(["ls", str(src)]) == 0
    assert main(["rewrite", str(src), "-o", str(tmp_path / "o"), "--dry-run"]) == 0
    assert len(calls) == 2, len(calls)  # one shape, once per table: was 6,000
    assert capsys.readouterr().out.count(" [16] ") == 2 * len(tensors)


def test_a_header_is_rendered_a_chunk_at_a_time(monkeypatch):
    """encode_header rendered each entry by itself (its name through _json, its fields by a
    format): 0.1 s of a 92k-tensor copy. orjson now renders CHUNK entries in one call."""
    from streamck.source import header

    calls = []
    real = header._json
    monkeypatch.setattr(header, "_json", lambda v: calls.append(v) or real(v))
    entries = [
        (f"model.layers.{i // 100}.mlp.experts.{i % 100}.up_proj.weight", "BF16", (16, 16), 512) for i in range(20000)
    ]
    raw = header.encode_header(entries, {"format": "pt"})
    assert len(calls) <= 1, len(calls)  # the metadata
    parsed = header.parse_header(raw[8:], 20000 * 512, Path("m.safetensors"))
    assert [r.name for r in parsed.tensors] == [e[0] for e in entries] and parsed.tensors[
        -1
    ].end - parsed.data_start == 20000 * 512
