"""The safetensors format, in one place: reading a header strictly, and writing one.

The rules are the reference reader's (``safetensors`` 0.8): an 8-byte
little-endian length, at most 100 MB of UTF-8 JSON that is an object, each
entry ``{"dtype", "shape", "data_offsets"}`` (extra fields ignored), an
optional ``__metadata__`` map of strings, and tensors that tile the data area
exactly: no gap, no overlap, no trailing byte. One rule is stricter: a key
given twice in any object (a tensor name, a metadata key) is refused, where the
reference silently keeps the last one.
Nothing here allocates more than the header's real size. Writing is the
reference writer's: compact JSON, ``__metadata__`` first, spaces padding the data
area's start to a multiple of 8 (or of a larger alignment asked for).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import orjson

from streamck.dtypes import BITS
from streamck.errors import CheckpointError, OutputError
from streamck.source.runs import Run, Tile, strided_runs, tile_runs

MAX_HEADER = 100_000_000  # the reference reader's cap on the JSON header, in bytes
METADATA_KEY = "__metadata__"
ALIGN = 8  # the data area starts at a multiple of this
_U64 = 1 << 64


class TensorRef(NamedTuple):
    """Where one tensor's bytes live; ``runs()`` lists them in row-major order.

    A plain tensor is ``path[start:end]``, absolute offsets. ``strides`` (in elements)
    is set only for a non-contiguous view saved by torch: then ``start`` is its first
    element and ``end - start`` its logical size, and the bytes are gathered
    (streamck.source.strided). ``tiles`` is set for a tensor stored in blocks (one per
    rank): then ``path`` is the first block's file, ``end - start`` the logical size,
    and the blocks tile the tensor (or, when they are 1-D, its flattened elements).
    ``end - start`` is always the tensor's byte size.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    path: Path
    start: int
    end: int
    strides: tuple[int, ...] | None = None
    tiles: tuple[Tile, ...] | None = None

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def paths(self) -> tuple[Path, ...]:
        """Every file that holds some of this tensor's bytes."""
        if self.tiles is None:
            return (self.path,)
        return tuple(dict.fromkeys(t.path for t in self.tiles))

    def runs(self) -> Iterator[Run]:
        """The byte runs whose concatenation is this tensor, lazily (see streamck.source.runs)."""
        if self.tiles is not None:
            grid = self.shape if len(self.tiles[0].offsets) == len(self.shape) else (self.numel,)
            return tile_runs(grid, BITS[self.dtype] // 8, self.tiles)
        if self.strides is not None:
            return strided_runs(self)
        return iter((Run(self.path, self.start, self.end - self.start),) if self.end > self.start else ())


_new_ref = tuple.__new__  # NamedTuple's own __new__ is a Python lambda: 4x slower per tensor


@dataclass(frozen=True, slots=True)
class Header:
    tensors: list[TensorRef]  # in file order
    metadata: dict[str, str]
    data_start: int


class _Invalid(Exception):
    pass


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise _Invalid(f"key {dup!r} appears twice in one object")
    return d


def _no_constant(name: str) -> float:
    raise _Invalid(f"{name} is not JSON")


def _parse_int(text: str) -> int | float:
    return -0.0 if text == "-0" else int(text)  # serde reads -0 as a float


def _parse_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise _Invalid(f"number {text} out of range")
    return value


def _has_surrogate(value: object) -> bool:
    if isinstance(value, str):
        return any("\ud800" <= c <= "\udfff" for c in value)
    if isinstance(value, dict):
        return any(_has_surrogate(k) or _has_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_surrogate(v) for v in value)
    return False


def _decode_json(raw: bytes) -> dict:
    # Fast path: orjson, accepted only when the header is exactly orjson's own rendering
    # of what it parsed. That proves no key was given twice (a duplicate would be
    # missing from the re-rendering) and no number was read loosely. Anything else,
    # hand-written or odd, goes through the exact, slower stdlib parse below.
    try:
        obj = orjson.loads(raw)
        if type(obj) is dict and orjson.dumps(obj) == raw.strip(b" \t\r\n"):
            return obj
    except orjson.JSONDecodeError:
        pass
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _Invalid(f"header is not UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        obj = json.loads(
            text,
            object_pairs_hook=_no_duplicates,
            parse_constant=_no_constant,
            parse_int=_parse_int if "-0" in text else None,  # the hook is slow; -0 is rare
            parse_float=_parse_float,
        )
    except json.JSONDecodeError as e:
        raise _Invalid(f"header is not valid JSON ({e.msg} at char {e.pos})") from None
    except RecursionError:
        raise _Invalid("header JSON is nested too deeply") from None
    if not isinstance(obj, dict):
        raise _Invalid(f"header is JSON {type(obj).__name__}, not an object")
    if "\\u" in text and _has_surrogate(obj):
        raise _Invalid("header has a lone UTF-16 surrogate escape")
    return obj


def _uint(value: object) -> bool:
    return type(value) is int and 0 <= value < _U64


def _entry(name: str, entry: object) -> tuple[str, tuple[int, ...], int, int]:
    if not isinstance(entry, dict):
        raise _Invalid(f"tensor {name!r}: entry is not an object")
    try:
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    except KeyError as e:
        raise _Invalid(f"tensor {name!r}: missing field {e.args[0]!r}") from None
    if type(dtype) is not str or dtype not in BITS:
        raise _Invalid(f"tensor {name!r}: unknown dtype {dtype!r}")
    if type(shape) is not list or not all(map(_uint, shape)):
        raise _Invalid(f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
    if type(offsets) is not list or len(offsets) != 2 or not (_uint(offsets[0]) and _uint(offsets[1])):
        raise _Invalid(f"tensor {name!r}: data_offsets {offsets!r} is not two non-negative integers")
    return dtype, tuple(shape), offsets[0], offsets[1]


def _size_error(name: str, dtype: str, shape: list[int], numel: int, bits: int, span: int) -> None:
    if bits >= _U64 * 8:
        raise _Invalid(f"tensor {name!r}: shape {shape} overflows")
    if bits % 8:
        raise _Invalid(f"tensor {name!r}: {numel} elements of {dtype} are not a whole number of bytes")
    raise _Invalid(f"tensor {name!r}: shape {shape} of {dtype} needs {bits // 8} bytes, data_offsets span {span}")


def parse_header(raw: bytes, data_size: int, path: Path) -> Header:
    """Validate the JSON header ``raw`` of a file whose data area holds ``data_size`` bytes.

    Raises CheckpointError naming ``path`` and the first thing that is wrong.
    """
    data_start = 8 + len(raw)
    try:
        obj = _decode_json(raw)
        metadata = obj.pop(METADATA_KEY, None)
        if metadata is None:
            metadata = {}
        elif not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
            raise _Invalid(f"{METADATA_KEY} is not a map of strings to strings")
        tensors, end, in_order = [], 0, True
        for name, e in obj.items():
            # Fast path for well-formed entries; _entry() re-checks a bad one to say what is wrong.
            try:
                dtype, shape, (start, stop) = e["dtype"], e["shape"], e["data_offsets"]
                ok = dtype in BITS and type(shape) is list and type(start) is int and type(stop) is int
            except (TypeError, KeyError, ValueError):
                ok = False
            if not ok or start < 0 or stop >= _U64:
                dtype, shape, start, stop = _entry(name, e)
            numel = 1
            for d in shape:
                if type(d) is not int or d < 0 or d >= _U64:
                    _entry(name, e)
                numel *= d
            bits = numel * BITS[dtype]
            if bits != (stop - start) * 8:
                _size_error(name, dtype, shape, numel, bits, stop - start)
            in_order = in_order and start == end
            end = stop
            tensors.append(
                _new_ref(
                    TensorRef, (name, dtype, tuple(shape), path, data_start + start, data_start + stop, None, None)
                )
            )
        if not in_order:  # writers usually list tensors by offset; others get sorted and checked
            tensors.sort(key=lambda t: (t.start, t.end))
            end = data_start
            for t in tensors:
                if t.start != end:
                    what = "overlaps the previous tensor" if t.start < end else "leaves a gap before it"
                    raise _Invalid(
                        f"tensor {t.name!r}: data_offsets [{t.start - data_start}, {t.end - data_start}] {what}"
                    )
                end = t.end
            end -= data_start
        if end != data_size:
            if end > data_size:
                raise _Invalid(f"file is truncated: tensors need {end} data bytes, file has {data_size}")
            raise _Invalid(f"{data_size - end} trailing bytes after the last tensor")
    except _Invalid as e:
        raise CheckpointError(str(e), path) from None
    return Header(tensors, metadata, data_start)


def read_header(path: str | os.PathLike) -> Header:
    """Read and validate the header of the safetensors file at ``path``; never reads tensor data."""
    path = path if isinstance(path, Path) else Path(path)  # keep the caller's object: refs share it
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"file is {size} bytes, too short for a safetensors header", path)
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER:
                raise CheckpointError(f"header length {n} is above the {MAX_HEADER}-byte cap", path)
            if 8 + n > size:
                raise CheckpointError(f"header length {n} runs past the end of the {size}-byte file", path)
            raw = f.read(n)
    except IsADirectoryError:
        raise CheckpointError("is a directory, expected a .safetensors file", path) from None
    except OSError as e:
        raise CheckpointError(f"cannot read: {e.strerror}", path) from None
    return parse_header(raw, size - 8 - n, path)


def encode_header(
    tensors: Iterable[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str], align: int = ALIGN
) -> bytes:
    """The 8-byte length, compact JSON header and space padding for ``(name, dtype, shape,
    nbytes)`` entries laid out in that order.

    Padding makes ``8 + header length`` a multiple of ``align`` (itself a multiple of 8),
    so the data area starts aligned. Raises OutputError above the readers' cap.
    """
    entries: dict[str, object] = {}
    if metadata:
        entries[METADATA_KEY] = dict(sorted(metadata.items()))
    offset = 0
    for name, dtype, shape, size in tensors:
        entries[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % align)
    if len(raw) > MAX_HEADER:
        raise OutputError(
            f"the header of one file would be {len(raw)} bytes, above the {MAX_HEADER}-byte "
            "cap of safetensors readers; split the output with --max-shard-size"
        )
    return struct.pack("<Q", len(raw)) + raw
