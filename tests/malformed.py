"""The malformed (and tricky but valid) files that streamck and the reference reader must judge alike."""

from __future__ import annotations

import json

from helpers import raw_bytes

_file = raw_bytes


def _compact(header: dict, data: bytes = b"") -> bytes:
    """As the reference writer renders a header: the orjson fast path reads these."""
    return _file(json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode(), data)


def _x(value: str, compact: bool = False) -> bytes:
    """A valid one-byte tensor whose extra field ``x`` holds the JSON text ``value``."""
    if compact:
        return _file(b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":' + value.encode() + b"}}", b"a")
    return _file(b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1], "x": ' + value.encode() + b"}}", b"a")


def _nest(depth: int, open_: str = "[", close: str = "]") -> str:
    return open_ * depth + close * depth


def _t(dtype: str, shape: list, start: int, end: int, **extra) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [start, end], **extra}


# name -> (file bytes, does the reference reader accept it?)
CASES: dict[str, tuple[bytes, bool]] = {
    "empty file": (b"", False),
    "shorter than 8 bytes": (b"\x02\x00\x00", False),
    "header length beyond the file": (_file(b"{}", length=64), False),
    "header length above the cap": (_file(b"{}", length=100_000_001), False),
    "header length 10^12": (_file(b"{}", length=10**12), False),
    "header not UTF-8": (_file(b'{"\xff\xfe": 1}'), False),
    "header not JSON": (_file(b"{nope"), False),
    "header JSON array": (_file(b"[]"), False),
    "header JSON string": (_file(b'"x"'), False),
    "zero-length header": (_file(b""), False),
    "NaN in header": (_file(b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1], "x": NaN}}', b"a"), False),
    "UTF-8 BOM": (_file(b"\xef\xbb\xbf{}"), False),
    "NUL padding": (_file(b"{}\x00\x00"), False),
    "missing dtype": (_file({"a": {"shape": [1], "data_offsets": [0, 1]}}, b"a"), False),
    "missing shape": (_file({"a": {"dtype": "U8", "data_offsets": [0, 1]}}, b"a"), False),
    "missing data_offsets": (_file({"a": {"dtype": "U8", "shape": [1]}}, b"a"), False),
    "entry not an object": (_file({"a": 5}), False),
    "unknown dtype": (_file({"a": _t("Q4_K", [1], 0, 1)}, b"a"), False),
    "lowercase dtype": (_file({"a": _t("f32", [1], 0, 4)}, b"abcd"), False),
    "negative dim": (_file({"a": _t("U8", [-1], 0, 1)}, b"a"), False),
    "float dim": (_file({"a": _t("U8", [1.0], 0, 1)}, b"a"), False),
    "minus-zero dim": (_file(b'{"a": {"dtype": "U8", "shape": [-0], "data_offsets": [0, 0]}}'), False),
    "bool dim": (_file({"a": _t("U8", [True], 0, 1)}, b"a"), False),
    "string dim": (_file({"a": _t("U8", ["1"], 0, 1)}, b"a"), False),
    "dim above u64": (_file({"a": _t("U8", [2**64], 0, 1)}, b"a"), False),
    "shape overflows": (_file({"a": _t("U8", [2**32, 2**32], 0, 1)}, b"a"), False),
    "three offsets": (_file({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1, 1]}}, b"a"), False),
    "size disagrees with range": (_file({"a": _t("F32", [2], 0, 4)}, b"abcd"), False),
    "offsets reversed": (_file({"a": _t("U8", [0], 1, 0)}, b"a"), False),
    "beyond the data area": (_file({"a": _t("U8", [4], 0, 4)}, b"ab"), False),
    "overlapping": (_file({"a": _t("U8", [2], 0, 2), "b": _t("U8", [2], 1, 3)}, b"abc"), False),
    "gap": (_file({"a": _t("U8", [1], 0, 1), "b": _t("U8", [1], 2, 3)}, b"abc"), False),
    "trailing bytes": (_file({"a": _t("U8", [1], 0, 1)}, b"ab"), False),
    "truncated shard": (_file({"a": _t("F32", [256], 0, 1024)}, b"\0" * 1000), False),
    "metadata not a map": (_file({"__metadata__": ["x"]}), False),
    "metadata value not a string": (_file({"__metadata__": {"k": 1}}), False),
    "metadata nested": (_file({"__metadata__": {"k": {"x": "y"}}}), False),
    "duplicate field in entry": (
        _file(b'{"a": {"dtype": "U8", "dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}', b"a"),
        False,
    ),
    "lone surrogate": (_file(b'{"\\ud800": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}', b"a"), False),
    "sub-byte not whole bytes": (_file({"a": _t("F4", [3], 0, 2)}, b"ab"), False),
    # valid, as the reference reads them
    "empty header": (_file(b"{}"), True),
    "null metadata": (_file({"__metadata__": None}), True),
    "zero-size tensor": (_file({"a": _t("F32", [0, 7], 0, 0)}), True),
    "scalar": (_file({"a": _t("F64", [], 0, 8)}, b"\0" * 8), True),
    "unknown extra fields": (_file({"a": _t("U8", [2], 0, 2, note=[1, {"x": None}], more="y")}, b"ab"), True),
    "whitespace around JSON": (
        _file(b'\n\t {"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}} \r\n', b"a"),
        True,
    ),
    "unsorted offsets": (_file({"b": _t("U8", [1], 1, 2), "a": _t("U8", [1], 0, 1)}, b"ab"), True),
    "empty name": (_file({"": _t("U8", [1], 0, 1)}, b"a"), True),
    "unicode names": (_file({"模型.权重": _t("U8", [1], 0, 1)}, b"a"), True),
    "F4 and F6 whole bytes": (_file({"a": _t("F4", [4], 0, 2), "b": _t("F6_E2M3", [4], 2, 5)}, b"abcde"), True),
    "header length not a multiple of 8": (_file(b"{} "), True),
    # serde_json's limits, which the reference's parse keeps even in fields it ignores:
    # 128 nested containers (the header object and the entry count: 125 more fit) ...
    "nested 127 deep": (_x(_nest(125)), True),
    "nested 128 deep": (_x(_nest(126)), False),
    "nested 127 deep, compact": (_x(_nest(125), compact=True), True),
    "nested 128 deep, compact": (_x(_nest(126), compact=True), False),
    "nested 300 deep, compact": (_x(_nest(300), compact=True), False),  # past orjson's 254 for dumps
    "nested 2000 deep": (_x(_nest(2000)), False),
    "dicts nested 128 deep": (_x('{"k":' * 126 + "1" + "}" * 126), False),
    # ... numbers: integers past u64 become f64, which must not overflow; floats likewise,
    # by serde's own (not correctly rounded) reading
    "integer past u64": (_x(str(2**64)), True),
    "integer below i64": (_x(str(-(2**63) - 1)), True),
    "integer of 309 digits": (_x("1" + "0" * 308), True),
    "integer of 310 digits": (_x("1" + "0" * 309), False),
    "integer of 309 nines": (_x("9" * 309), False),
    "integer of 5000 digits": (_x("7" * 5000), False),  # past Python's int-string limit too
    "integer just under f64 max": (_x(str(2**1024 - 2**971)), False),  # serde's rounding overflows
    "float 1e309": (_x("1e309"), False),
    "float -1E400": (_x("-1E400"), False),
    "float f64 max": (_x("1.7976931348623157e308"), True),
    "float f64 max, compact": (_x("1.7976931348623157e308", compact=True), True),
    "float rounding to f64 max": (_x("1.7976931348623158e308"), False),  # finite in Python
    "float of 5000 digits": (_x("1." + "3" * 5000), True),
    "float of 5000 integer digits": (_x("3" * 5000 + ".5"), False),
    "float underflowing to zero": (_x("1e-400"), True),
    "exponent past i32": (_x("1e2147483648"), False),
    "zero with exponent past i32": (_x("0e99999999999"), True),
    "negative exponent past i32": (_x("1e-99999999999"), True),
    # element counts multiply in order, each step checked against 64 bits
    "shape overflows before a zero dim": (_file({"a": _t("U8", [2**63, 2, 0], 0, 0)}), False),
    "shape overflows before a zero dim, compact": (_compact({"a": _t("U8", [2**32, 2**32, 0], 0, 0)}), False),
    "shape with a zero dim first": (_file({"a": _t("U8", [0, 2**63, 2], 0, 0)}), True),
    "shape with a zero dim mid-way": (_compact({"a": _t("U8", [2**63, 0, 2**63], 0, 0)}), True),
    "shape just under 2^64 before a zero dim": (_file({"a": _t("U8", [2**32, 2**32 - 1, 0], 0, 0)}), True),
    "shape bits overflow": (_file({"a": _t("F64", [2**61], 0, 2**64 - 8)}), False),
    "empty header, compact": (_file(b"{}"), True),
    "only metadata": (_compact({"__metadata__": {"format": "pt"}}), True),
}

# Deliberate differences (README, "Differences from the reference reader"): files the
# reference reads and streamck refuses, with the words streamck's refusal contains.
DIFFERENCES: dict[str, tuple[bytes, str]] = {
    "duplicate tensor name": (
        _file(
            b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}, '
            b'"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}',
            b"a",
        ),
        "key 'a' appears twice",
    ),
    "duplicate metadata key": (_file(b'{"__metadata__": {"format": "pt", "format": "np"}}'), "appears twice"),
    "duplicate key in an ignored field": (_x('{"k": 1, "k": 2}'), "key 'k' appears twice"),
    "duplicate ignored field": (
        _file(b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1], "x": 1, "x": 2}}', b"a"),
        "key 'x' appears twice",
    ),
    "entry as a JSON array": (_file(b'{"a": ["U8", [1], [0, 1]]}', b"a"), "entry is not an object"),
    "entry as a JSON array, compact": (_file(b'{"a":["F32",[2],[0,8]]}', bytes(8)), "entry is not an object"),
    "dtype as a map": (
        _file(b'{"a": {"dtype": {"U8": null}, "shape": [1], "data_offsets": [0, 1]}}', b"a"),
        "dtype {'U8': None} is not a string",
    ),
}
DIFFERENCE_WORDS = ("appears twice", "entry is not an object", "is not a string")

# The one documented disagreement: the reference keeps the last of two same-named
# entries (tensors, or metadata keys); streamck refuses the file.
DUPLICATE_NAMES = _file(
    b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, '
    b'"a": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}',
    b"ab",
)
DUPLICATE_NAMES_REF_ACCEPTS = _file(
    b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}, '
    b'"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}',
    b"a",
)
DUPLICATE_METADATA_KEY = _file(b'{"__metadata__": {"format": "pt", "format": "np"}}')
