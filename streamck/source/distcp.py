"""Native torch.distributed.checkpoint (``dcp.save`` + ``FileSystemWriter``), without torch.

``.metadata`` is a pickle of torch's ``Metadata``, read with an allow-list of stand-in
classes; for each chunk it names a ``(file, offset, length)`` range of a
``__R_I.distcp`` file that is a whole ``torch.save`` archive of that chunk, whose
storage record holds the chunk's C-contiguous bytes. Non-tensor items
(``BytesStorageMetadata``) are skipped with a notice and never unpickled.
"""

from __future__ import annotations

import math
import pickle
import re
import struct
import zipfile
from pathlib import Path, PurePosixPath
from typing import NamedTuple

from streamck.dtypes import BITS
from streamck.errors import CheckpointError
from streamck.source.dcp import Entry, _finish, _int_tuple
from streamck.source.runs import Tile
from streamck.source.torchzip import MAX_PICKLE, TORCH_DTYPES, _Lazy, load_archive

METADATA_FILE = ".metadata"


# ---------------------------------------------------------------- native DCP: .metadata


class _Stub:
    """A DCP metadata dataclass: pickle's BUILD fills ``__dict__`` from the saved state."""

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots) for frozen/slotted classes
            state = {**(state[0] or {}), **(state[1] or {})}
        if not isinstance(state, dict):
            raise pickle.UnpicklingError(f"{type(self).__name__} state is a {type(state).__name__}")
        self.__dict__.update(state)


class _Metadata(_Stub):
    pass


class _TensorStorage(_Stub):
    pass


class _BytesStorage(_Stub):
    pass


class _Chunk(_Stub):
    pass


class _Index(_Stub):
    pass


class _StorageInfo(_Stub):
    pass


class _StorageMeta(_Stub):
    pass


class _TensorProperties(_Stub):
    def __setstate__(self, state):  # (dtype, layout, requires_grad, memory format, pin_memory)
        if isinstance(state, tuple) and len(state) == 5:
            self.dtype = state[0]
        else:
            super().__setstate__(state)


class _TorchDtype(NamedTuple):
    name: str  # "float32"


def _size(*args):
    seq = args[0] if args else ()
    value = _int_tuple(seq)
    if value is None or len(args) > 1:
        raise pickle.UnpicklingError(f"torch.Size of {seq!r:.60}")
    return value


def _plain(*args):  # layouts, memory-format codes, paths: recorded, never used
    return args


_META_CLASSES = {
    "Metadata": _Metadata,
    "TensorStorageMetadata": _TensorStorage,
    "BytesStorageMetadata": _BytesStorage,
    "ChunkStorageMetadata": _Chunk,
    "TensorProperties": _TensorProperties,
    "MetadataIndex": _Index,
    "StorageMeta": _StorageMeta,
    "_MEM_FORMAT_ENCODING": _plain,
}
_DTYPE_NAME = re.compile(r"(u?int\d+|float\d+\w*|bfloat16|complex\d+|bool|q(u?int)\w+|bits\w+)")


class _MetadataUnpickler(pickle.Unpickler):
    """What torch 2.13's ``.metadata`` names (see pickletools on a real file), nothing else."""

    def find_class(self, module: str, name: str):
        if module == "torch.distributed.checkpoint.metadata" and name in _META_CLASSES:
            return _META_CLASSES[name]
        if module == "torch.distributed.checkpoint.filesystem" and name == "_StorageInfo":
            return _StorageInfo
        if module == "torch" and name == "Size":
            return _size
        if module == "torch" and _DTYPE_NAME.fullmatch(name):
            return _TorchDtype(name)
        if (module, name) == ("torch.serialization", "_get_layout"):
            return _plain
        if module == "pathlib" and name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"):
            return _plain
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: not part of DCP metadata")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("persistent id in DCP metadata")


def _load_metadata(path: Path) -> _Metadata:
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_PICKLE + 1)
    except FileNotFoundError:
        raise CheckpointError("no .metadata file: not a native DCP checkpoint directory", path.parent) from None
    except OSError as e:
        raise CheckpointError(f"cannot read: {e.strerror}", path) from None
    if len(raw) > MAX_PICKLE:
        raise CheckpointError(f"above the {MAX_PICKLE}-byte cap", path)
    import io

    try:
        md = _MetadataUnpickler(io.BytesIO(raw)).load()
    except (pickle.UnpicklingError, TypeError, ValueError, AttributeError, EOFError, IndexError, KeyError) as e:
        raise CheckpointError(f"refused: {e}", path) from None
    if not isinstance(md, _Metadata):
        raise CheckpointError(f"holds a {type(md).__name__}, not DCP Metadata", path)
    if not isinstance(getattr(md, "state_dict_metadata", None), dict):
        raise CheckpointError("Metadata has no state_dict_metadata map", path)
    if not isinstance(getattr(md, "storage_data", None), dict):
        raise CheckpointError("Metadata has no storage_data map (not written by FileSystemWriter?)", path)
    return md


def _relative(rel: object, directory: Path, md_path: Path) -> Path:
    if not isinstance(rel, str) or not rel:
        raise CheckpointError(f"storage record names file {rel!r:.60}", md_path)
    pure = PurePosixPath(rel)
    if pure.is_absolute() or ".." in pure.parts or "\\" in rel:
        raise CheckpointError(f"storage record names {rel!r}, outside the checkpoint directory", md_path)
    return directory / rel


class _Location(NamedTuple):
    path: Path
    offset: int
    length: int
    transforms: object = None  # _StorageInfo.transform_descriptors: absent unless an extension was used


def _storage_map(md: _Metadata, directory: Path, md_path: Path) -> dict[tuple[str, tuple[int, ...] | None], _Location]:
    out: dict[tuple[str, tuple[int, ...] | None], _Location] = {}
    for index, info in md.storage_data.items():
        if not isinstance(index, _Index) or not isinstance(info, _StorageInfo):
            raise CheckpointError("storage_data is not a map of MetadataIndex to _StorageInfo", md_path)
        fqn, offset = getattr(index, "fqn", None), getattr(index, "offset", None)
        if not isinstance(fqn, str):
            raise CheckpointError(f"storage record with fqn {fqn!r:.60}", md_path)
        start, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (type(start) is int and type(length) is int and start >= 0 and length >= 0):
            raise CheckpointError(f"{fqn!r}: storage record range {start!r}, {length!r}", md_path)
        key = (fqn, None if offset is None else _int_tuple(offset))
        if key in out:
            raise CheckpointError(f"{fqn!r}: two storage records for the chunk at {offset}", md_path)
        rel = _relative(getattr(info, "relative_path", None), directory, md_path)
        out[key] = _Location(rel, start, length, getattr(info, "transform_descriptors", None))
    return out


# ---------------------------------------------------------------- native DCP: chunk blobs


class _Window:
    """``length`` bytes of an open file from ``base``, as a seekable file for zipfile."""

    def __init__(self, f, base: int, length: int):
        self.f, self.base, self.length, self.pos = f, base, length, 0

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = max(0, (0, self.pos, self.length)[whence] + offset)
        return self.pos

    def read(self, n: int = -1) -> bytes:
        n = self.length - self.pos if n is None or n < 0 else min(n, max(0, self.length - self.pos))
        self.f.seek(self.base + self.pos)
        data = self.f.read(n)
        self.pos += len(data)
        return data


def _blob_tensor(f, where: _Location, size: int, name: str, chunk: str) -> tuple[_Lazy, int, int]:
    """The tensor a ``torch.save`` blob holds, its storage record's absolute data start and size."""
    what = f"tensor {name!r} chunk at {chunk}"
    if where.offset + where.length > size:
        raise CheckpointError(
            f"{what}: bytes [{where.offset}, +{where.length}) run past the {size}-byte file", where.path
        )
    window = _Window(f, where.offset, where.length)
    try:
        obj, _, records, prefix = load_archive(window, where.path)
    except CheckpointError as e:
        raise CheckpointError(f"{what}: blob at byte {where.offset}: {e.message}", where.path) from None
    if not isinstance(obj, _Lazy):
        raise CheckpointError(f"{what}: blob holds a {type(obj).__name__}, not a tensor", where.path)
    info = records.get(f"{prefix}data/{obj.storage.key}")
    if info is None:
        raise CheckpointError(f"{what}: storage record data/{obj.storage.key} is missing", where.path)
    if info.compress_type != zipfile.ZIP_STORED:
        raise CheckpointError(f"{what}: storage record is compressed; streamck reads stored ones", where.path)
    f.seek(where.offset + info.header_offset)
    local = f.read(30)
    if len(local) != 30 or local[:4] != b"PK\x03\x04":
        raise CheckpointError(f"{what}: storage record has a bad local header", where.path)
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    if name_len != len(info.orig_filename.encode()):
        raise CheckpointError(f"{what}: local header and central directory disagree", where.path)
    data = info.header_offset + 30 + name_len + extra_len
    if data + info.file_size > where.length:
        raise CheckpointError(f"{what}: storage record runs past the blob", where.path)
    return obj, where.offset + data, info.file_size


def _chunk_tile(f, where: _Location, size: int, name: str, dtype: str, chunk: _Chunk) -> Tile:
    offsets, sizes = _int_tuple(getattr(chunk, "offsets", None)), _int_tuple(getattr(chunk, "sizes", None))
    if offsets is None or sizes is None or len(offsets) != len(sizes):
        raise CheckpointError(f"tensor {name!r}: chunk with offsets/sizes {offsets}/{sizes}", where.path)
    t, start, stored = _blob_tensor(f, where, size, name, str(list(offsets)))
    what = f"tensor {name!r} chunk at {list(offsets)}"
    if t.dtype != dtype:
        raise CheckpointError(f"{what}: blob holds {t.dtype}, .metadata says {dtype}", where.path)
    if t.size != sizes:
        raise CheckpointError(f"{what}: blob holds shape {list(t.size)}, .metadata says {list(sizes)}", where.path)
    expect = 1
    for d, s in zip(reversed(t.size), reversed(t.stride), strict=False):
        if len(t.stride) != len(t.size) or (d != 1 and s != expect):
            raise CheckpointError(f"{what}: blob tensor is not C-contiguous (strides {list(t.stride)})", where.path)
        expect *= d
    if type(t.offset) is not int or t.offset < 0:
        raise CheckpointError(f"{what}: storage offset {t.offset!r}", where.path)
    item = BITS[dtype] // 8
    need = math.prod(sizes) * item
    if (t.offset * item) + need > stored:
        raise CheckpointError(
            f"{what}: storage record holds {stored} bytes, the chunk needs {need} from element {t.offset}", where.path
        )
    return Tile(where.path, start + t.offset * item, offsets, sizes)


def read_distcp(directory: Path) -> tuple[dict[str, Entry], list[str]]:
    """Index a native DCP checkpoint directory (``.metadata`` + ``*.distcp``) by tensor.

    Returns the entries in ``.metadata`` order and one notice per skipped non-tensor item.
    """
    directory = directory if isinstance(directory, Path) else Path(directory)
    md_path = directory / METADATA_FILE
    md = _load_metadata(md_path)
    where = _storage_map(md, directory, md_path)
    notices: list[str] = []
    plans: list[tuple[str, str, tuple[int, ...], list[tuple[_Chunk, _Location]]]] = []
    for name, meta in md.state_dict_metadata.items():
        if not isinstance(name, str):
            raise CheckpointError(f"state dict key {name!r:.60} is not a string", md_path)
        if isinstance(meta, _BytesStorage):
            loc = where.get((name, None))
            held = f", {loc.length} bytes in {loc.path.name}" if loc else ""
            notices.append(f"{name}: non-tensor item (DCP bytes{held}) skipped")
            continue
        if not isinstance(meta, _TensorStorage):
            raise CheckpointError(f"{name!r}: storage metadata is a {type(meta).__name__}", md_path)
        raw = getattr(getattr(meta, "properties", None), "dtype", None)
        dtype = TORCH_DTYPES.get(raw.name) if isinstance(raw, _TorchDtype) else None
        if dtype is None:
            shown = f"torch.{raw.name}" if isinstance(raw, _TorchDtype) else repr(raw)
            raise CheckpointError(f"tensor {name!r}: unknown or unsupported dtype {shown}", md_path)
        shape = _int_tuple(getattr(meta, "size", None))
        chunks = getattr(meta, "chunks", None)
        if shape is None or not isinstance(chunks, list) or not all(isinstance(c, _Chunk) for c in chunks):
            raise CheckpointError(f"tensor {name!r}: malformed size or chunk list", md_path)
        located, files = [], {}
        for c in chunks:
            offsets = _int_tuple(getattr(c, "offsets", None))
            loc = where.get((name, offsets))
            if loc is None:
                raise CheckpointError(f"tensor {name!r}: no storage record for the chunk at {offsets}", md_path)
            if loc.transforms:
                raise CheckpointError(
                    f"tensor {name!r} is stored through transforms {list(loc.transforms)}: "
                    "streamck reads untransformed chunks only",
                    md_path,
                )
            if loc.path in files:
                raise CheckpointError(
                    f"tensor {name!r}: chunks at {files[loc.path]} and {offsets} are both in {loc.path.name}", md_path
                )
            files[loc.path] = offsets
            located.append((c, loc))
        plans.append((name, dtype, shape, located))

    entries: dict[str, Entry] = {}
    handles: dict[Path, tuple[object, int]] = {}
    try:
        for name, dtype, shape, located in plans:
            tiles = []
            for chunk, loc in located:
                if loc.path not in handles:
                    try:
                        f = open(loc.path, "rb")
                    except FileNotFoundError:
                        raise CheckpointError("file named by .metadata is missing (a rank file?)", loc.path) from None
                    except OSError as e:
                        raise CheckpointError(f"cannot read: {e.strerror}", loc.path) from None
                    f.seek(0, 2)
                    handles[loc.path] = (f, f.tell())
                f, size = handles[loc.path]
                tiles.append(_chunk_tile(f, loc, size, name, dtype, chunk))
            entries[name] = _finish(name, dtype, shape, tiles, md_path)
    finally:
        for f, _ in handles.values():
            f.close()
    return entries, notices
