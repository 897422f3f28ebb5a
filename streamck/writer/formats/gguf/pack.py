"""gguf-py's ``GGUFWriter``, its arrays packed in bulk: a vocabulary's 128k tokens and 280k merges
are one ``_pack_val`` call each per item there (two thirds of a bf16 conversion's time on a
1 GiB Llama 3). What a key says stays gguf-py's (its ``add_*`` methods, types and order); only how
an array of strings, ints or floats becomes bytes changes, to the same bytes: a GGUF array is its
item type (uint32), its count (uint64) and its items, a string its uint64 length and its UTF-8
bytes, in the writer's byte order. Anything else (nested arrays, bools, mixed item types, values
``struct`` refuses) is gguf-py's own ``_pack_val``'s, errors included.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from itertools import chain
from typing import Any

import gguf
import numpy as np
from gguf import GGUFValueType

_NUMBERS = {GGUFValueType.INT32: "i4", GGUFValueType.FLOAT32: "f4"}


class Writer(gguf.GGUFWriter):
    """``gguf.GGUFWriter`` whose arrays of strings, int32 and float32 are packed by pack_array."""

    def _pack_val(
        self, val: Any, vtype: GGUFValueType, add_vtype: bool, sub_type: GGUFValueType | None = None
    ) -> bytes:
        if vtype == GGUFValueType.ARRAY and sub_type is None:
            order = "<" if self.endianess == gguf.GGUFEndian.LITTLE else ">"
            body = pack_array(val, order)
            if body is not None:
                return (self._pack("I", vtype) if add_vtype else b"") + body
        return super()._pack_val(val, vtype, add_vtype, sub_type)


def pack_array(val: Any, order: str = "<") -> bytes | None:
    """``val`` as a GGUF array's bytes after its value type (item type, count, items) in byte
    ``order`` (``<`` or ``>``), as gguf-py's ``_pack_val`` packs it; None where that is not a
    non-empty sequence of one Python type that gguf-py packs as a string, an int32 or a float32,
    or where ``struct`` would refuse an item (out of range, not UTF-8): gguf-py's to pack."""
    if not isinstance(val, Sequence) or isinstance(val, bytes) or len(val) == 0:
        return None
    try:
        kind = GGUFValueType.get_type(val[0])
    except ValueError:
        return None
    if len(set(map(type, val))) != 1:
        return None
    if kind == GGUFValueType.STRING:
        items = _strings(val, order)
    elif kind in _NUMBERS:
        items = _numbers(val, kind, order)
    else:
        return None
    if items is None:
        return None
    return struct.pack(f"{order}IQ", kind, len(val)) + items


def _strings(val: Sequence[str | bytes | bytearray], order: str) -> bytes | None:
    """Each string's uint64 byte length, then its UTF-8 bytes (bytes as they are)."""
    try:
        encoded = list(map(str.encode, val)) if isinstance(val[0], str) else val
    except UnicodeEncodeError:
        return None
    lengths = map(struct.Struct(f"{order}Q").pack, map(len, encoded))
    return b"".join(chain.from_iterable(zip(lengths, encoded, strict=True)))


def _numbers(val: Sequence[int | float], kind: GGUFValueType, order: str) -> bytes | None:
    """The values as int32 or float32 (``struct``'s rounding of a double to a float: the C cast);
    None for an int out of range, a NaN (its bits left to ``struct``) or a float past float32's range."""
    try:
        wide = np.array(val, dtype=np.int64 if kind == GGUFValueType.INT32 else np.float64)
    except (OverflowError, TypeError, ValueError):
        return None
    with np.errstate(over="ignore", invalid="ignore"):
        narrow = wide.astype(order + _NUMBERS[kind])
    if kind == GGUFValueType.INT32:
        fits = wide.min() >= -(1 << 31) and wide.max() < (1 << 31)
    else:
        fits = not (np.isnan(wide).any() or (np.isfinite(wide) & np.isinf(narrow)).any())
    return narrow.tobytes() if fits else None
