"""Hostile input: streamck is at least as strict as the reference reader, and says why in one line."""

import json
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from malformed import CASES, DUPLICATE_METADATA_KEY, DUPLICATE_NAMES, DUPLICATE_NAMES_REF_ACCEPTS
from safetensors import safe_open

from streamck import CheckpointError, PlanError, load_rules, open_checkpoint
from streamck.cli import main
from streamck.dtypes import BITS


def reference(path):
    """What the reference reader makes of ``path``: None if it refuses, else its view."""
    try:
        with safe_open(str(path), "np") as f:
            return {
                "metadata": f.metadata() or {},
                "tensors": {k: (s.get_dtype(), s.get_shape()) for k in f.keys() for s in [f.get_slice(k)]},
            }
    except Exception:
        return None


def ours(path):
    """What streamck makes of ``path``: None if it refuses with its own error, else its view."""
    try:
        ckpt = open_checkpoint(path)
    except CheckpointError:
        return None
    return {"metadata": ckpt.metadata, "tensors": {n: (t.dtype, list(t.shape)) for n, t in ckpt.tensors.items()}}


@pytest.mark.parametrize("case", CASES)
def test_agrees_with_reference_reader(tmp_path, case):
    data, accepted = CASES[case]
    path = tmp_path / "x.safetensors"
    path.write_bytes(data)
    ref = reference(path)
    assert (ref is not None) == accepted, "the case list is wrong about the reference"
    mine = ours(path)
    if ref is None:
        assert mine is None
    else:
        assert mine == {
            "metadata": ref["metadata"],
            "tensors": {k: (d, list(s)) for k, (d, s) in ref["tensors"].items()},
        }


@pytest.mark.parametrize(
    ("data", "key"), [(DUPLICATE_NAMES, "a"), (DUPLICATE_NAMES_REF_ACCEPTS, "a"), (DUPLICATE_METADATA_KEY, "format")]
)
def test_duplicate_keys_refused_where_reference_keeps_the_last(tmp_path, data, key):
    path = tmp_path / "dup.safetensors"
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match=f"key '{key}' appears twice"):
        open_checkpoint(path)


@pytest.mark.parametrize("data", [DUPLICATE_NAMES_REF_ACCEPTS, DUPLICATE_METADATA_KEY])
def test_reference_really_accepts_the_duplicate(tmp_path, data):
    path = tmp_path / "dup.safetensors"
    path.write_bytes(data)
    assert reference(path) is not None  # the documented disagreement still exists


@pytest.mark.parametrize("case", [c for c, (_, ok) in CASES.items() if not ok])
def test_cli_error_is_one_line_naming_the_file(tmp_path, capsys, case):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(CASES[case][0])
    out = tmp_path / "out"
    assert main(["rewrite", str(path), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"streamck: error: {path}: ")
    assert not out.exists()


def test_huge_claims_allocate_nothing(tmp_path):
    import resource
    import subprocess
    import sys

    # 10^12-byte header length and a tensor claiming 1 TB: refused from the header alone.
    big = tmp_path / "big.safetensors"
    hdr = json.dumps({"a": {"dtype": "U8", "shape": [10**12], "data_offsets": [0, 10**12]}}).encode()
    big.write_bytes(struct.pack("<Q", len(hdr)) + hdr + b"x" * 10)

    def limit():  # 512 MiB of address space: any attempt to buffer the claim would fail
        resource.setrlimit(resource.RLIMIT_AS, (512 << 20, 512 << 20))

    proc = subprocess.run(
        [sys.executable, "-m", "streamck", "ls", str(big)], capture_output=True, text=True, preexec_fn=limit
    )
    assert proc.returncode == 2 and "truncated" in proc.stderr


def _index(directory, weight_map, raw=None):
    text = raw if raw is not None else json.dumps({"weight_map": weight_map})
    (directory / "model.safetensors.index.json").write_text(text)


def _shard(directory, name, tensors):
    header, data, off = {}, b"", 0
    for t in tensors:
        header[t] = {"dtype": "U8", "shape": [2], "data_offsets": [off, off + 2]}
        data += b"xy"
        off += 2
    raw = json.dumps(header).encode()
    (directory / name).write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda d: _index(d, {}, raw="{not json"), "not valid JSON"),
        (lambda d: _index(d, {}, raw='{"weight_map": [1]}'), "no 'weight_map' object"),
        (lambda d: _index(d, {"a": "nope.safetensors"}), "does not exist"),
        (
            lambda d: (_shard(d, "s1.safetensors", ["a"]), _index(d, {"a": "s1.safetensors", "b": "s1.safetensors"})),
            "puts 'b' in s1.safetensors, which does not hold it",
        ),
        (
            lambda d: (
                _shard(d, "s1.safetensors", ["a"]),
                _shard(d, "s2.safetensors", ["a"]),
                _index(d, {"a": "s1.safetensors", "b": "s2.safetensors"}),
            ),
            "'a' is also in s1.safetensors",
        ),
        (
            lambda d: (_shard(d, "s1.safetensors", ["a", "z"]), _index(d, {"a": "s1.safetensors"})),
            "missing from weight_map: 'z'",
        ),
        (lambda d: _index(d, {"a": "../outside.safetensors"}), "escapes the checkpoint directory"),
        (lambda d: _index(d, {"a": "/etc/hostname"}), "escapes the checkpoint directory"),
    ],
)
def test_sharded_checkpoint_errors(tmp_path, capsys, setup, message):
    ck = tmp_path / "ck"
    ck.mkdir()
    _shard(tmp_path, "outside.safetensors", ["a"])
    setup(ck)
    with pytest.raises(CheckpointError, match=message):
        open_checkpoint(ck)
    assert main(["ls", str(ck)]) == 2
    err = capsys.readouterr().err
    assert (err.count("\n") == 1 and "model.safetensors.index.json" in err) or "s2.safetensors" in err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("rules = [{strip_prefix = }", "not valid TOML"),
        ("rules = [{rename = '([a-z=x'}]", "unterminated character set"),
        ("rules = [{drop = 'model.[abc'}]", "never closed"),
        ("rules = [{keep = '[z-a]*'}]", "reversed range"),
    ],
)
def test_bad_plan_files(tmp_path, capsys, text, message):
    plan = tmp_path / "plan.toml"
    plan.write_text(text)
    with pytest.raises(PlanError, match=message):
        load_rules(plan)
    _shard(tmp_path, "s.safetensors", ["a"])
    assert main(["rewrite", str(tmp_path / "s.safetensors"), "-o", str(tmp_path / "o"), "--plan", str(plan)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(plan) in err
    assert not (tmp_path / "o").exists()


# --- property test: random and mutated files -------------------------------------------

DTYPES = st.sampled_from([*sorted(BITS), "X8", "f32"])
DIM = st.one_of(st.integers(0, 6), st.integers(-2, 2**65), st.floats(0, 4), st.booleans(), st.text(max_size=2))


@st.composite
def headers(draw):
    # Half the headers are well formed (so that acceptance is exercised too); the
    # rest get a flaw or several, anywhere.
    clean = draw(st.booleans())
    skew = st.just(0) if clean else st.sampled_from([0, 0, 0, 1, -1])
    n = draw(st.integers(0, 5))
    entries, offset = {}, 0
    for _ in range(n):
        dtype = draw(st.sampled_from(sorted(BITS)) if clean else DTYPES)
        shape = (
            draw(st.lists(st.integers(0, 5), max_size=3))
            if clean or draw(st.booleans())
            else draw(st.lists(DIM, max_size=3))
        )
        size = 1
        for d in shape:
            size *= d if type(d) is int and d >= 0 else 1
        nbytes = size * BITS.get(dtype, 8) // 8 + draw(skew)
        start = offset + draw(skew)
        entry = {"dtype": dtype, "shape": shape, "data_offsets": [start, start + nbytes]}
        if not clean and draw(st.integers(0, 9)) == 0:
            del entry[draw(st.sampled_from(sorted(entry)))]
        entries[draw(st.text(max_size=6))] = entry
        offset = max(offset, start + nbytes)
    meta = draw(
        st.one_of(
            st.none(),
            st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2),
            *([] if clean else [st.just({"k": 1})]),
        )
    )
    if meta is not None or draw(st.booleans()):
        entries["__metadata__"] = meta
    raw = json.dumps(entries).encode() + b" " * draw(st.integers(0, 8))
    data = bytes(min(4096, max(0, offset + draw(skew))))
    return struct.pack("<Q", len(raw)) + raw + data


@st.composite
def mutated(draw):
    data = bytearray(draw(headers()))
    for _ in range(draw(st.integers(1, 4))):
        if not data:
            break
        op = draw(st.sampled_from(["flip", "cut", "grow", "dup"]))
        i = draw(st.integers(0, len(data) - 1))
        if op == "flip":
            data[i] = draw(st.integers(0, 255))
        elif op == "cut":
            del data[i:]
        elif op == "grow":
            data[i:i] = draw(st.binary(max_size=4))
        else:
            data[i:i] = data[i : i + draw(st.integers(1, 12))]
    return bytes(data)


def check_against_reference(path, data):
    path.write_bytes(data)
    try:
        mine = ours(path)
    except CheckpointError:
        raise
    except Exception as e:
        pytest.fail(f"streamck raised {type(e).__name__}: {e}")
    ref = reference(path)
    if mine is None:
        return  # refusing is always allowed when the reference refuses; checked next
    assert ref is not None, f"streamck accepted a file the reference refuses: {data[:200]!r}"
    assert mine == {"metadata": ref["metadata"], "tensors": {k: (d, list(s)) for k, (d, s) in ref["tensors"].items()}}


def refused_both_or_neither(path, data):
    path.write_bytes(data)
    mine, ref = ours(path), reference(path)
    if mine is None and ref is not None:
        try:
            open_checkpoint(path)
        except CheckpointError as e:
            assert "appears twice" in str(e), f"streamck refused what the reference accepts: {e}; {data[:200]!r}"


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(headers(), mutated()))
def test_property_random_and_mutated_files(tmp_path, data):
    path = tmp_path / "p.safetensors"
    check_against_reference(path, data)
    refused_both_or_neither(path, data)


def test_the_long_fuzz_script_runs():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent / "fuzz_headers.py"
    proc = subprocess.run([sys.executable, str(script), "--examples", "50"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "50 examples: streamck and the reference reader agree" in proc.stdout
