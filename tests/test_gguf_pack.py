"""GGUF's header in bulk (streamck/writer/formats/gguf/pack.py and compat.py): the same bytes and
the same vocabulary as gguf-py's own ``GGUFWriter._pack_val`` and ``SpecialVocab``, which stay the
authority: every check here compares with what gguf-py does for the same input."""

from __future__ import annotations

import itertools
import json
import math

import gguf
import numpy as np
import pytest

from streamck.writer.formats.gguf import compat, pack

STRINGS = {
    "ascii": ["a", "bc", "<|begin_of_text|>"],
    "empty strings": ["", "x", "", ""],
    "non-ASCII": ["é", "Ġhello", "日本語", "🦙", "\u0120\u010a", "\x00"],
    "one item": ["only"],
    "bytes": [b"\xff\xfe", b"", b"abc"],  # SentencePiece's pieces
    "bytearrays": [bytearray(b"\x00\x01"), bytearray()],
}
NUMBERS = {
    "token types": [gguf.TokenType.NORMAL, gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED] * 3,
    "ints": [0, -1, 2**31 - 1, -(2**31), 7],
    "one int": [5],
    "floats": [0.0, -0.0, 0.1, -1000.0, 1e-40, 3.4e38, 1 / 3, 2.0**-149, 65504.00000001],
    "infinities": [math.inf, -math.inf, 1.0],
    "one float": [-10000.0],
    "np.float64": [np.float64(0.5), np.float64(0.1)],
}
REFUSED = {  # gguf-py refuses these: the same error, from gguf-py itself
    "mixed types": ["a", 1],
    "int and bool": [1, True],
    "int32 overflow": [2**31],
    "huge int": [2**70],
    "float32 overflow": [1e39],
    "lone surrogate": ["\ud800"],
    "empty": [],
    "numpy array": np.arange(3),
}
OTHERS = {  # packed by gguf-py, through the fallback: the same bytes
    "bools": [True, False],
    "nested": [[1, 2], [3]],
    "nan": [math.nan, 1.0],
    "str and bytes": ["a", b"b"],
}


def _writers(order: gguf.GGUFEndian):
    return gguf.GGUFWriter(None, "llama", endianess=order), pack.Writer(None, "llama", endianess=order)


@pytest.mark.parametrize("order", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
@pytest.mark.parametrize("case", [*STRINGS, *NUMBERS, *OTHERS])
def test_arrays_pack_as_gguf_py_packs_them(case, order):
    theirs, ours = _writers(order)
    val = {**STRINGS, **NUMBERS, **OTHERS}[case]
    for add_vtype in (True, False):
        want = theirs._pack_val(val, gguf.GGUFValueType.ARRAY, add_vtype=add_vtype)
        assert ours._pack_val(val, gguf.GGUFValueType.ARRAY, add_vtype=add_vtype) == want


@pytest.mark.parametrize("case", [*STRINGS, *NUMBERS])
def test_bulk_packing_is_what_runs(case):
    """The cases above are packed by pack_array itself (else they would prove nothing about it)."""
    assert pack.pack_array({**STRINGS, **NUMBERS}[case]) is not None


@pytest.mark.parametrize("case", [*REFUSED, *OTHERS])
def test_the_rest_is_gguf_py_s(case):
    """What pack_array does not pack (None) is gguf-py's: its bytes, or its error."""
    val = {**REFUSED, **OTHERS}[case]
    assert pack.pack_array(val) is None
    if case in REFUSED:
        theirs, ours = _writers(gguf.GGUFEndian.LITTLE)
        with pytest.raises(Exception) as want:
            theirs._pack_val(val, gguf.GGUFValueType.ARRAY, add_vtype=True)
        with pytest.raises(want.type):
            ours._pack_val(val, gguf.GGUFValueType.ARRAY, add_vtype=True)


def test_a_whole_header_is_gguf_py_s():
    """A vocabulary's worth of keys (random tokens, types, scores, merges) and the scalar keys
    around them: pack.Writer writes the header, key-values and tensor infos gguf-py writes."""
    import io

    rng = np.random.default_rng(0)
    alphabet = [*"abcĠĊé日🦙 ", "", "<|x|>"]
    tokens = ["".join(rng.choice(alphabet, rng.integers(0, 6))) for _ in range(5000)]
    types = [gguf.TokenType(t) for t in rng.integers(1, 6, len(tokens))]
    scores = [float(s) for s in rng.normal(0, 100, len(tokens))]
    out = []
    for w in _writers(gguf.GGUFEndian.LITTLE):
        w.add_tensor_info("token_embd.weight", (8, 4), np.dtype(np.float32), 128)
        w.add_name("tiny")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_scores(scores)
        w.add_token_merges([f"{a} {b}" for a, b in itertools.pairwise(tokens)])
        w.add_bos_token_id(1)
        w.fout, w.state = [io.BytesIO()], gguf.gguf_writer.WriterState.EMPTY
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        out.append(w.fout[0].getvalue())
    assert out[0] == out[1] and len(out[0]) > 100_000


def _folder(tmp_path, merges, **extra):
    """A folder with a tokenizer.json holding ``merges`` and a template post-processor."""
    post = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>"}}, {"Sequence": {"id": "A"}}]}
    data = {"added_tokens": [{"id": 0, "content": "<s>"}], "post_processor": post, **extra}
    data["model"] = {"type": "BPE", "vocab": {"<s>": 0, "a": 1}, "merges": merges}
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "add_bos_token": True}))
    return tmp_path


MERGES = {
    "pairs": [["a", "b"], ["Ġ", "t"], ["日", "本"], ["", "x"]],
    "pairs with spaces": [["a", "b"], ["a b", "c"], [" ", " x "], ["é", " "]],
    "strings": ["a b", "Ġ t"],  # the format before transformers 4.45: gguf-py's to read
    "one pair": [["x", "y"]],
    "three parts": [["a", "b"], ["c", "d", "e"]],  # gguf-py joins them all: merges() leaves it to gguf-py
}


@pytest.mark.parametrize("case", MERGES)
def test_merges_are_gguf_py_s(tmp_path, case, caplog):
    """SpecialVocab's merges, special tokens and flags equal gguf-py's for the same folder
    (the vendored ByteLevel rule aside: this folder has no ByteLevel post-processor)."""
    folder = _folder(tmp_path, MERGES[case])
    want = gguf.SpecialVocab(folder, load_merges=True)
    warned = [r.getMessage() for r in caplog.records]
    caplog.clear()
    got = compat.SpecialVocab(folder, load_merges=True)
    compat.forget()
    assert got.merges == want.merges and len(got.merges) == len(MERGES[case])
    assert (got.special_token_ids, got.add_special_token) == (want.special_token_ids, want.add_special_token)
    assert [r.getMessage() for r in caplog.records] == warned
    assert any("Spaces in merges" in m for m in warned) == (case == "pairs with spaces")
    read_by_gguf_py = compat.merges(json.loads((folder / "tokenizer.json").read_text())) is None
    assert read_by_gguf_py == (case in ("strings", "three parts"))


def test_merges_gguf_py_refuses_are_refused(tmp_path):
    """A merges list gguf-py does not know: gguf-py's error, raised by gguf-py."""
    folder = _folder(tmp_path, [[1, 2]])
    with pytest.raises(ValueError, match="Unknown tokenizer merges format"):
        gguf.SpecialVocab(folder, load_merges=True)
    with pytest.raises(ValueError, match="Unknown tokenizer merges format"):
        compat.SpecialVocab(folder, load_merges=True)
    compat.forget()


def test_tokenizer_json_is_parsed_once(tmp_path, monkeypatch):
    """The plan pass's check and the header's vocabulary share one parse; a changed file is
    parsed again; forget() drops it; what orjson refuses (NaN) is json's parse."""
    from streamck.writer.formats.gguf import meta, table

    calls = []
    real = compat.orjson.loads
    monkeypatch.setattr(compat.orjson, "loads", lambda raw: calls.append(1) or real(raw))
    folder = _folder(tmp_path, MERGES["pairs"])
    family = table.FAMILIES["Qwen3ForCausalLM"]
    assert meta.check_tokenizer(folder, family) == "bpe"
    meta.check_tokenizer(folder, family)
    compat.SpecialVocab(folder, load_merges=True)
    assert len(calls) == 1
    _folder(tmp_path, MERGES["one pair"], extra="x" * 10)
    assert compat.SpecialVocab(folder, load_merges=True).merges == ["x y"] and len(calls) == 2
    compat.forget()
    assert compat._PARSED == {}
    (tmp_path / "tokenizer.json").write_text('{"a": NaN, "model": {}}')
    assert math.isnan(compat.tokenizer_json(tmp_path / "tokenizer.json")["a"])
    compat.forget()
