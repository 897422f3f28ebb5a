"""The safetensors format, in one place: reading a header strictly, and writing one.

The rules are the reference reader's (``safetensors`` 0.8): an 8-byte
little-endian length, at most 100 MB of UTF-8 JSON that is an object, each
entry ``{"dtype", "shape", "data_offsets"}`` (extra fields ignored), an
optional ``__metadata__`` map of strings, and tensors that tile the data area
exactly: no gap, no overlap, no trailing byte. Its JSON parser's limits are
kept too (streamck.source.serde: containers nested at most 127 deep, numbers
that serde_json's float reading does not overflow, anywhere, extra fields
included), and element counts whose running product stays within 64 bits even
before a zero dimension.
Stricter, on purpose (docs/notes.md, "Differences from the reference reader"): a key
given twice in any object is refused, where the reference keeps the last one or
ignores it; an entry must be a JSON object and a dtype a string, where serde
also takes ``["F32", [2], [0, 8]]`` and ``{"F32": null}``.
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
from streamck.source.runs import Run, Tile, tile_runs
from streamck.source.serde import MAX_NESTING, decode_json, serde_overflows
from streamck.source.serde import Invalid as _Invalid
from streamck.source.sniff import SAMPLE, looks_like
from streamck.storage import ByteSource, UrlPath, location, open_source

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
    ``parts`` is set for a tensor gathered from others' rows (streamck.source.select):
    its bytes are the parts' bytes one after another, ``path`` the first part's.
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
    parts: tuple[TensorRef, ...] | None = None

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
        if self.parts is not None:
            return tuple(dict.fromkeys(p for part in self.parts for p in part.paths))
        if self.tiles is None:
            return (self.path,)
        return tuple(dict.fromkeys(t.path for t in self.tiles))

    def runs(self) -> Iterator[Run]:
        """The byte runs whose concatenation is this tensor, lazily (see streamck.source.runs).
        A strided view has none: its bytes are gathered in blocks (streamck.source.strided)."""
        if self.parts is not None:
            return (run for part in self.parts for run in part.runs())
        if self.tiles is not None:
            if not self.tiles:  # no elements
                return iter(())
            grid = self.shape if len(self.tiles[0].offsets) == len(self.shape) else (self.numel,)
            return tile_runs(grid, BITS[self.dtype] // 8, self.tiles)
        if self.strides is not None:  # one run per element of a transposed matrix: gathered instead
            raise ValueError(f"{self.name}: a strided view is read through a Reader (streamck.source.strided)")
        return iter((Run(self.path, self.start, self.end - self.start),) if self.end > self.start else ())


_new_ref = tuple.__new__  # NamedTuple's own __new__ is a Python lambda: 4x slower per tensor


@dataclass(frozen=True, slots=True)
class Header:
    tensors: list[TensorRef]  # in file order
    metadata: dict[str, str]
    data_start: int


def _check_extra(name: str, entry: dict, fast: bool) -> None:
    """The fields of a tensor entry that are not read still obey the reference's JSON
    limits: nesting (the header object and the entry are two levels) and numbers. An
    integer's text is its value's; a float's is checked by the stdlib parse's hook, or,
    after the orjson fast path, is orjson's rendering of it (the path proved so)."""
    todo = [(v, 3) for k, v in entry.items() if k not in _FIELDS]
    while todo:
        value, depth = todo.pop()
        if type(value) is float and fast:
            text = orjson.dumps(value).decode()  # a float's text, as the fast path proved it
            if serde_overflows(text):
                raise _Invalid(f"tensor {name!r}: number {text} out of range")
        elif type(value) is int and not -_U64 < value < _U64 and serde_overflows(str(value)):
            raise _Invalid(f"tensor {name!r}: integer of {len(str(abs(value)))} digits out of range")
        elif isinstance(value, dict | list):
            if depth > MAX_NESTING:
                raise _Invalid(f"tensor {name!r}: JSON nested more than {MAX_NESTING} deep")
            todo.extend((v, depth + 1) for v in (value.values() if type(value) is dict else value))


_FIELDS = frozenset(("dtype", "shape", "data_offsets"))


def _uint(value: object) -> bool:
    return type(value) is int and 0 <= value < _U64


def _entry(name: str, entry: object, fast: bool) -> tuple[str, tuple[int, ...], int, int]:
    if not isinstance(entry, dict):
        what = " (serde's array form of one is not read)" if isinstance(entry, list) else ""
        raise _Invalid(f"tensor {name!r}: entry is not an object{what}")
    if len(entry) != 3:
        _check_extra(name, entry, fast)
    try:
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    except KeyError as e:
        raise _Invalid(f"tensor {name!r}: missing field {e.args[0]!r}") from None
    if type(dtype) is not str:
        raise _Invalid(f"tensor {name!r}: dtype {dtype!r} is not a string")
    if dtype not in BITS:
        raise _Invalid(f"tensor {name!r}: unknown dtype {dtype!r}")
    if type(shape) is not list or not all(map(_uint, shape)):
        raise _Invalid(f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
    if type(offsets) is not list or len(offsets) != 2 or not (_uint(offsets[0]) and _uint(offsets[1])):
        raise _Invalid(f"tensor {name!r}: data_offsets {offsets!r} is not two non-negative integers")
    return dtype, tuple(shape), offsets[0], offsets[1]


def _check_size(name: str, dtype: str, shape: list[int], bits: int, span: int) -> None:
    """Refuse a tensor whose size the fast check could not accept; return if it is fine.

    The reference multiplies the dimensions in order, then by the dtype's bits, each step
    checked against 64 bits: ``[2**63, 2, 0]`` overflows though it holds nothing.
    """
    numel = 1
    for d in shape:
        numel *= d
        if numel >= _U64:
            raise _Invalid(f"tensor {name!r}: shape {shape} overflows 64 bits")
    if bits >= _U64:
        raise _Invalid(f"tensor {name!r}: shape {shape} of {dtype} overflows 64 bits")
    if bits == span * 8:
        return
    if bits % 8:
        raise _Invalid(f"tensor {name!r}: {numel} elements of {dtype} are not a whole number of bytes")
    raise _Invalid(f"tensor {name!r}: shape {shape} of {dtype} needs {bits // 8} bytes, data_offsets span {span}")


def parse_header(raw: bytes, data_size: int, path: Path) -> Header:
    """Validate the JSON header ``raw`` of a file whose data area holds ``data_size`` bytes.

    Raises CheckpointError naming ``path`` and the first thing that is wrong.
    """
    data_start = 8 + len(raw)
    try:
        obj, fast = decode_json(raw)
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
                ok = (
                    dtype in BITS
                    and type(shape) is list
                    and type(start) is int
                    and type(stop) is int
                    and len(e) == 3  # extra fields: _entry() checks them
                )
            except (TypeError, KeyError, ValueError):
                ok = False
            if not ok or start < 0 or stop >= _U64:
                dtype, shape, start, stop = _entry(name, e, fast)
            numel = 1
            for d in shape:
                if type(d) is not int or d < 0 or d >= _U64:
                    _entry(name, e, fast)
                numel *= d
            bits = numel * BITS[dtype]
            if bits != (stop - start) * 8 or not bits:  # zero elements: did a prefix overflow?
                _check_size(name, dtype, shape, bits, stop - start)
            in_order = in_order and start == end
            end = stop
            tensors.append(
                _new_ref(
                    TensorRef,
                    (name, dtype, tuple(shape), path, data_start + start, data_start + stop, None, None, None),
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
        if data_size >= 1 << 61:  # only here can a tensor's bits pass 2**64 with its span in range
            for t in tensors:
                _check_size(t.name, t.dtype, list(t.shape), t.numel * BITS[t.dtype], t.nbytes)
        if end != data_size:
            if end > data_size:
                raise _Invalid(f"file is truncated: tensors need {end} data bytes, file has {data_size}")
            raise _Invalid(f"{data_size - end} trailing bytes after the last tensor")
    except _Invalid as e:
        raise CheckpointError(str(e), path) from None
    return Header(tensors, metadata, data_start)


def read_header(path: str | os.PathLike) -> Header:
    """Read and validate the header of the safetensors file at ``path`` (a local path or a
    UrlPath, streamck.storage); never reads tensor data: 8 bytes, then the header's."""
    path = path if isinstance(path, Path | UrlPath) else location(path)  # keep the caller's object: refs share it
    try:
        src = open_source(path)
    except IsADirectoryError:
        raise CheckpointError("is a directory, expected a .safetensors file", path) from None
    except OSError as e:
        raise CheckpointError(f"cannot read: {e.strerror}", path) from None
    try:
        size = src.size
        prefix = _read(src, 0, 8)
        if len(prefix) < 8:
            if looks_like(prefix) is not None:
                raise CheckpointError(f"is not a safetensors file: it looks like {looks_like(prefix)}", path)
            raise CheckpointError(f"file is {size} bytes, too short for a safetensors header", path)
        (n,) = struct.unpack("<Q", prefix)
        if n > MAX_HEADER or (8 + n > size and _read(src, 8, 1) != b"{"):  # no header: some other file
            what = looks_like(_read(src, 0, SAMPLE))
            if what is not None:
                raise CheckpointError(f"is not a safetensors file: it looks like {what}", path)
        if n > MAX_HEADER:
            raise CheckpointError(f"header length {n} is above the {MAX_HEADER}-byte cap", path)
        if 8 + n > size:
            raise CheckpointError(f"header length {n} runs past the end of the {size}-byte file", path)
        raw = _read(src, 8, n)
    except OSError as e:
        raise CheckpointError(f"cannot read: {e.strerror}", path) from None
    finally:
        src.close()
    return parse_header(raw, size - 8 - n, path)


def _json(value: object) -> bytes:
    """``value`` as JSON, as ``json.dumps(value, ensure_ascii=False)`` renders it compactly
    (orjson's rendering is that, for every code point, and faster); the stdlib's own outcome
    for what orjson refuses (a lone surrogate: UnicodeEncodeError, as before)."""
    try:
        return orjson.dumps(value, default=int)  # default: a numpy integer in a shape
    except orjson.JSONEncodeError:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=int).encode("utf-8")


def _read(src: ByteSource, offset: int, n: int) -> bytes:
    """Up to ``n`` bytes of ``src`` at ``offset``: fewer only where the file ends."""
    buf = bytearray(max(0, min(n, src.size - offset)))
    src.readinto(memoryview(buf), offset)
    return bytes(buf)


CHUNK = 4096  # header entries rendered by one orjson call


def _entries(chunk: dict[str, dict]) -> bytes:
    """``chunk``'s entries as they stand inside the header's braces (see encode_header)."""
    try:
        return orjson.dumps(chunk, default=int)[1:-1]  # default: a numpy integer in a shape
    except orjson.JSONEncodeError:  # a lone surrogate, an integer past 64 bits: as _json renders them
        return b",".join(_json(name) + b":" + _json(entry) for name, entry in chunk.items())


def encode_header(
    tensors: Iterable[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str], align: int = ALIGN
) -> bytes:
    """The 8-byte length, compact JSON header and space padding for ``(name, dtype, shape,
    nbytes)`` entries laid out in that order.

    Padding makes ``8 + header length`` a multiple of ``align`` (itself a multiple of 8),
    so the data area starts aligned. Raises OutputError above the readers' cap.

    Byte for byte ``json.dumps(header, separators=(",", ":"), ensure_ascii=False)`` of the
    header as a dict, rendered by orjson CHUNK entries at a time: one dict for the whole
    header was 50 MB at the peak of a 92k-tensor copy, and one format call per entry 0.1 s
    of it (#44).
    """
    pieces = [b'"' + METADATA_KEY.encode() + b'":' + _json(dict(sorted(metadata.items())))] if metadata else []
    offset, chunk, seen = 0, {}, set()
    for name, dtype, shape, size in tensors:
        if name in seen:
            raise ValueError(f"tensor {name!r} twice in one header")
        seen.add(name)
        chunk[name] = {"dtype": dtype, "shape": shape, "data_offsets": (offset, offset + size)}
        offset += size
        if len(chunk) == CHUNK:
            pieces.append(_entries(chunk))
            chunk = {}
    if chunk:
        pieces.append(_entries(chunk))
    parts = [b"", b"{"]  # the length prefix goes first, once the length is known
    for i, piece in enumerate(pieces):
        parts += (b",", piece) if i else (piece,)
    parts.append(b"}")
    length = sum(map(len, parts))
    parts.append(b" " * (-(8 + length) % align))
    length += len(parts[-1])
    if length > MAX_HEADER:
        raise OutputError(
            f"the header of one file would be {length} bytes, above the {MAX_HEADER}-byte "
            "cap of safetensors readers; split the output with {max_shard_size}"
        )
    parts[0] = struct.pack("<Q", length)
    return b"".join(parts)  # one copy: the parts and the header are the peak
