"""JSON as the reference reader (serde_json) reads it: the same refusals for nesting,
numbers, constants and surrogates, with Python's parsers, and one rule more (a key given
twice in an object is refused; serde keeps the last). The header module checks what the
JSON says; this one, what JSON is accepted at all."""

from __future__ import annotations

import json

import orjson

MAX_NESTING = 127  # serde_json's recursion limit (128) refuses the 128th nested container
_U64 = 1 << 64


class Invalid(Exception):
    pass


def no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    """``json.loads``'s object hook that refuses a key given twice (raises Invalid)."""
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise Invalid(f"key {dup!r} appears twice in one object")
    return d


def _no_constant(name: str) -> float:
    raise Invalid(f"{name} is not JSON")


_POW10 = [float(f"1e{i}") for i in range(309)]  # serde_json's table: 1e0 ..= 1e308
_U64_MAX = _U64 - 1


def serde_overflows(text: str) -> bool:
    """Whether serde_json (as the reference reader builds it: no ``float_roundtrip``)
    refuses the JSON number ``text`` as out of range.

    It keeps the leading digits that fit a u64, counts the rest into a decimal exponent
    and multiplies by a rounded power of ten, so its verdict near the top of the f64
    range differs from a correctly rounded parse (``1.7976931348623158e308`` is refused).
    This follows its ``parse_integer``, ``parse_decimal``, ``parse_exponent`` and
    ``f64_from_parts`` step by step; ``text`` is valid JSON number syntax.
    """
    i, n = (1 if text[0] == "-" else 0), len(text)
    sig = exponent = 0
    overflowed = False  # the significand is full: further digits only scale it

    def push(digit: int) -> bool:
        nonlocal sig
        if sig > _U64_MAX // 10 or (sig == _U64_MAX // 10 and digit > _U64_MAX % 10):
            return False
        sig = sig * 10 + digit
        return True

    while i < n and "0" <= text[i] <= "9":  # integer part (JSON: no leading zeros)
        if not overflowed and not push(ord(text[i]) - 48):
            overflowed = True
        if overflowed:
            exponent += 1
        i += 1
    if i < n and text[i] == ".":  # parse_decimal restarts pushing, even after an overflow
        i += 1
        while i < n and "0" <= text[i] <= "9":
            if not push(ord(text[i]) - 48):
                while i < n and "0" <= text[i] <= "9":
                    i += 1
                break
            exponent -= 1
            i += 1
    elif not overflowed and (i == n or text[i] not in "eE"):
        return False  # a u64 or i64 (or a float for -0 and below i64::MIN): always in range
    if i < n and text[i] in "eE":
        i += 1
        positive = text[i] != "-"
        i += text[i] in "+-"
        digits = text[i:].lstrip("0") or "0"
        if len(digits) > 10 or int(digits) > 2**31 - 1:  # parse_exponent_overflow
            return sig != 0 and positive
        exp = int(digits)
        exponent = max(-(2**31), min(2**31 - 1, exponent + exp if positive else exponent - exp))
    f = float(sig)
    while True:
        if abs(exponent) <= 308:
            return exponent >= 0 and f * _POW10[exponent] == float("inf")
        if f == 0.0:
            return False
        if exponent >= 0:
            return True
        f /= 1e308
        exponent += 308


def _parse_int(text: str) -> int | float:
    return -0.0 if text == "-0" else int(text)  # serde reads -0 as a float


def _parse_float(text: str) -> float:
    if serde_overflows(text):
        raise Invalid(f"number {text if len(text) <= 40 else text[:20] + '...'} out of range")
    return float(text)


def _has_surrogate(value: object) -> bool:
    if isinstance(value, str):
        return any("\ud800" <= c <= "\udfff" for c in value)
    if isinstance(value, dict):
        return any(_has_surrogate(k) or _has_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_surrogate(v) for v in value)
    return False


def decode_json(raw: bytes) -> tuple[dict, bool]:
    """The header object, and whether the orjson fast path read it."""
    # Fast path: orjson, accepted only when the header is exactly orjson's own rendering
    # of what it parsed. That proves no key was given twice (a duplicate would be
    # missing from the re-rendering) and no number was read loosely. Anything else,
    # hand-written or odd, goes through the exact, slower stdlib parse below.
    try:
        obj = orjson.loads(raw)
        if type(obj) is dict and orjson.dumps(obj) == raw.strip(b" \t\r\n"):
            return obj, True
    except (orjson.JSONDecodeError, orjson.JSONEncodeError):  # encode: nested past orjson's 254
        pass
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Invalid(f"header is not UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        obj = json.loads(
            text,
            object_pairs_hook=no_duplicates,
            parse_constant=_no_constant,
            parse_int=_parse_int if "-0" in text else None,  # the hook is slow; -0 is rare
            parse_float=_parse_float,
        )
    except json.JSONDecodeError as e:
        raise Invalid(f"header is not valid JSON ({e.msg} at char {e.pos})") from None
    except ValueError:  # Python's int-string limit: an integer of thousands of digits, far past f64
        raise Invalid("header has an integer of thousands of digits: out of range") from None
    except RecursionError:
        raise Invalid(f"header JSON is nested more than {MAX_NESTING} deep") from None
    if not isinstance(obj, dict):
        raise Invalid(f"header is JSON {type(obj).__name__}, not an object")
    if "\\u" in text and _has_surrogate(obj):
        raise Invalid("header has a lone UTF-16 surrogate escape")
    return obj, False
