"""The manifest format: stable, sorted, one line per tensor, exactly json.dumps per value."""

import json

from streamck.manifest import build_manifest, dumps, load_manifest

NAMES = [
    "plain.weight",
    'quote"d',
    "back\\slash",
    "tab\tand\nnewline",
    "\x01\x7f",
    "模型.权重",
    "emoji.\U0001f600",
    "line\u2028sep",
]


def test_dumps_is_json_with_one_line_per_tensor():
    rows = [(n, "BF16", (i, 2), 4 * i) for i, n in enumerate(NAMES)]
    m = build_manifest(rows, {"format": "pt", "b": "ü"}, extra={NAMES[0]: {"sha256": "ab"}})
    text = dumps(m)
    assert load_manifest(text) == m == json.loads(text)
    lines = text.split("\n")  # not splitlines(): U+2028 in a name is no line break in the file
    for name in NAMES:  # each tensor's line is exactly what json.dumps gives for its parts
        entry = m["tensors"][name]
        expected = (
            f"    {json.dumps(name, ensure_ascii=False)}: {json.dumps(entry, sort_keys=True, ensure_ascii=False)}"
        )
        assert expected in lines or expected + "," in lines
    assert list(m) == sorted(m) and list(m["tensors"]) == sorted(m["tensors"])
    assert m["total_size"] == sum(r[3] for r in rows) and m["version"] == 1


def test_empty_and_foreign_json():
    assert json.loads(dumps(build_manifest([], {}))) == {
        "format": "streamck-manifest",
        "metadata": {},
        "tensors": {},
        "total_size": 0,
        "version": 1,
    }
    assert load_manifest('{"weight_map": {}}') is None
