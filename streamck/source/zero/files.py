"""DeepSpeed rank files read without torch or deepspeed: a restricted unpickler whose
DeepSpeed objects are inert stand-ins, tensors located as flat runs in their storage
records, and a cursor that cuts a concatenation of such runs into tiles (streamck.source.zero.read
reads the layout they make up). The stand-ins are streamck.source.torchzip.inert's."""

from __future__ import annotations

import _compat_pickle
import math
import pickle
import struct
import zipfile
from pathlib import Path
from typing import NamedTuple

from streamck.dtypes import BITS
from streamck.errors import CheckpointError
from streamck.source.runs import Tile
from streamck.source.torchzip.archive import data_offset, load_archive
from streamck.source.torchzip.inert import NAMED_TYPES, PLAIN, TYPING, Opaque, is_data_only, stub
from streamck.source.torchzip.unpickle import Lazy, WeightsOnly, rebuild_tensor, size
from streamck.storage import ByteSource, open_file, open_source

_TENSOR_TYPES = {
    ("torch", "Tensor"),
    ("torch._tensor", "Tensor"),
    ("torch.nn.parameter", "Parameter"),
    ("torch.nn", "Parameter"),
}


def _rebuild_from_type_v2(func, new_type, args, state):
    """A tensor with Python attributes (ZeRO-3's ``ds_id``…): the tensor, attributes dropped."""
    if func is not rebuild_tensor or not isinstance(args, tuple):
        raise pickle.UnpicklingError("_rebuild_from_type_v2 of something other than a tensor")
    return func(*args)


def _codecs_encode(text, encoding="latin1"):
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError("_codecs.encode used for something other than bytes")
    return text.encode("latin1")


class _ZeroPickle(WeightsOnly):
    def find_class(self, module: str, name: str):
        if module == "deepspeed" or module.startswith("deepspeed.") or is_data_only(module, name):
            return stub(module, name)
        if (module, name) in TYPING:
            return stub(module, name)
        if module == "torch" and name == "Size":
            return size
        if module == "torch._tensor" and name == "_rebuild_from_type_v2":
            return _rebuild_from_type_v2
        if (module, name) in _TENSOR_TYPES:
            return name
        if module == "_codecs" and name == "encode":
            return _codecs_encode
        module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        if (module, name) in PLAIN:
            return PLAIN[module, name]
        if module == "builtins" and name in NAMED_TYPES:
            return stub(module, name)
        return super().find_class(module, name)


class Flat(NamedTuple):
    """A contiguous run of ``numel`` elements of ``dtype`` at ``path[start:]``."""

    path: Path
    start: int
    numel: int
    dtype: str


class RankFile:
    """One unpickled rank file and where its storage records' data start."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with open_file(path) as f:
                if f.read(4) != b"PK\x03\x04":
                    raise CheckpointError("not a zip archive (a legacy torch file?)", path)
                self.obj, storages, records, prefix = load_archive(f, path, _ZeroPickle)
                self.records: dict[str, tuple[int, int]] = {}  # stored records only: start, size
                for key in storages:
                    info = records.get(f"{prefix}data/{key}")
                    if info is None:
                        raise CheckpointError(f"storage record data/{key} is missing", path)
                    if info.compress_type == zipfile.ZIP_STORED:
                        self.records[key] = (data_offset(f, info, path), info.file_size)
        except OSError as e:
            raise CheckpointError(f"cannot read: {e.strerror}", path) from None
        if not isinstance(self.obj, dict):
            raise CheckpointError(f"data.pkl holds a {type(self.obj).__name__}, not a dict", path)

    def flat(self, t: object, what: str) -> Flat:
        """``t`` as a contiguous run in this file (checked against its storage record)."""
        if not isinstance(t, Lazy):
            raise CheckpointError(f"{what} is a {type(t).__name__}, not a tensor", self.path)
        item = BITS.get(t.dtype, 0) // 8
        if not item or not all(type(x) is int and x >= 0 for x in (t.offset, *t.size, *t.stride)):
            raise CheckpointError(f"{what}: unsupported dtype {t.dtype} or bad view", self.path)
        if len(t.stride) != len(t.size):
            raise CheckpointError(f"{what}: {len(t.size)} dims but {len(t.stride)} strides", self.path)
        numel, expect = math.prod(t.size), 1
        for d, s in zip(reversed(t.size), reversed(t.stride), strict=True):
            if d != 1 and s != expect:
                raise CheckpointError(f"{what}: a non-contiguous view", self.path)
            expect *= d
        if t.storage.key not in self.records:
            raise CheckpointError(f"{what}: storage record data/{t.storage.key} is compressed", self.path)
        start, size = self.records[t.storage.key]
        if (t.offset + numel) * item > size:
            raise CheckpointError(f"{what}: runs past its {size}-byte storage record", self.path)
        return Flat(self.path, start + t.offset * item, numel, t.dtype)


# What a rank file records of the save it belongs to; every rank file of one save agrees.
STAMP_KEYS = ("global_steps", "global_samples", "ds_version", "dp_world_size")
_SCALAR = {"F64": "<d", "F32": "<f", "I64": "<q", "I32": "<i"}


def save_stamp(rf: RankFile) -> dict[str, object]:
    """What ``rf`` records of its save: the engine's counters and version (model states),
    the version and the optimizer's step count (optimizer states)."""
    obj = rf.obj
    stamp = {k: obj[k] for k in STAMP_KEYS if isinstance(obj.get(k), (int, str))}
    osd = obj.get("optimizer_state_dict")
    if isinstance(osd, dict):
        if isinstance(osd.get("ds_version"), str):
            stamp["ds_version"] = osd["ds_version"]
        values = list(_find_key(osd, "step", 6))
        steps = {v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)}
        tensors = [v for v in values if isinstance(v, Lazy) and v.dtype in _SCALAR and math.prod(v.size) == 1]
        if tensors:  # torch's AdamW keeps its step as a one-element tensor per param group
            src = open_source(rf.path)
            try:
                steps |= {_read_scalar(src, rf.flat(t, "optimizer step")) for t in tensors}
            finally:
                src.close()
        if steps:
            stamp["optimizer step"] = max(steps)
    return stamp


def _find_key(obj: object, key: str, depth: int):
    """Every value under ``key`` in nested dicts and lists, down to ``depth`` levels."""
    if depth < 0:
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == key:
                yield v
            else:
                yield from _find_key(v, key, depth - 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _find_key(v, key, depth - 1)


def _read_scalar(src: ByteSource, f: Flat) -> int | float:
    raw = bytearray(BITS[f.dtype] // 8)
    src.readinto(memoryview(raw), f.start)
    return struct.unpack(_SCALAR[f.dtype], raw)[0]


def shape_of(v: object, what: str, path: Path) -> tuple[int, ...]:
    if isinstance(v, Opaque):  # never expected: torch.Size is read as a tuple
        raise CheckpointError(f"{what}: shape is a {type(v).__name__}", path)
    if not isinstance(v, (tuple, list)) or not all(type(d) is int and d >= 0 for d in v):
        raise CheckpointError(f"{what}: bad shape {v!r:.60}", path)
    return tuple(v)


def stage_of(v: object) -> object:
    if isinstance(v, Opaque) and len(v.args) == 1:
        return v.args[0]
    return v


class Cursor:
    """Walks a virtual concatenation of flat runs, handing out tiles."""

    def __init__(self, parts: list[Flat]):
        self.parts = parts
        self.bounds = [0]
        for p in parts:
            self.bounds.append(self.bounds[-1] + p.numel)

    @property
    def numel(self) -> int:
        return self.bounds[-1]

    def tiles(self, at: int, count: int, into: int) -> list[Tile]:
        """Tiles for elements ``[at, at+count)`` of the concatenation, placed from element ``into``."""
        out = []
        for i, p in enumerate(self.parts):
            lo, hi = max(at, self.bounds[i]), min(at + count, self.bounds[i + 1])
            if lo < hi:
                item = BITS[p.dtype] // 8
                out.append(Tile(p.path, p.start + (lo - self.bounds[i]) * item, (into + lo - at,), (hi - lo,)))
        return out
