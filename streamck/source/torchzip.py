"""A lazy index of a PyTorch zip checkpoint (``torch.save`` since 1.6), without torch.

``data.pkl`` is unpickled with weights-only rules: the only globals it may name
are the tensor and parameter rebuilders, storage and dtype markers, and
OrderedDict; anything else (``os.system``…) is refused before it could run.
Tensors become references into the archive's stored (uncompressed) storage
records; views keep their offset and strides.
"""

from __future__ import annotations

import collections
import pickle
import struct
import zipfile
from pathlib import Path

from streamck.dtypes import BITS
from streamck.errors import CheckpointError
from streamck.source.header import Header, TensorRef

MAX_PICKLE = 256 << 20  # a state dict of 100,000 tensors pickles to ~20 MB
TORCH_SUFFIXES = (".bin", ".pt", ".pth")

# Typed storage classes (torch < 2.x style, still written for classic dtypes) and dtypes.
STORAGE_DTYPES = {
    "DoubleStorage": "F64",
    "FloatStorage": "F32",
    "HalfStorage": "F16",
    "BFloat16Storage": "BF16",
    "LongStorage": "I64",
    "IntStorage": "I32",
    "ShortStorage": "I16",
    "CharStorage": "I8",
    "ByteStorage": "U8",
    "BoolStorage": "BOOL",
    "ComplexFloatStorage": "C64",
}
TORCH_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
    "complex64": "C64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float8_e8m0fnu": "F8_E8M0",
    "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
}
LEGACY_HINT = "re-save it in the zip format: torch.save(torch.load(path, weights_only=True), new_path)"


class _Storage:
    """A storage record: its key in the archive and the dtype it was saved with."""

    def __init__(self, key: str, dtype: str | None):
        self.key, self.dtype = key, dtype


class _Lazy:
    """A tensor as the pickle describes it: a view into a storage."""

    def __init__(self, storage, offset, size, stride, dtype=None):
        if not isinstance(storage, _Storage):
            raise pickle.UnpicklingError("tensor without a storage")
        self.storage, self.offset, self.size, self.stride = storage, offset, tuple(size), tuple(stride)
        self.dtype = dtype or storage.dtype
        if self.dtype is None:
            raise pickle.UnpicklingError(f"storage {storage.key} has no dtype")


def _rebuild_v2(storage, offset, size, stride, requires_grad=False, hooks=None, metadata=None):
    return _Lazy(storage, offset, size, stride)


def _rebuild_v3(storage, offset, size, stride, requires_grad, hooks, dtype, metadata=None):
    return _Lazy(storage, offset, size, stride, str(dtype))


def _rebuild_parameter(data, requires_grad=False, hooks=None, state=None):
    return data


class _WeightsOnly(pickle.Unpickler):
    def __init__(self, data: bytes):
        import io

        super().__init__(io.BytesIO(data))
        self.storages: dict[str, _Storage] = {}

    def find_class(self, module: str, name: str):
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "torch._utils":
            fn = {
                "_rebuild_tensor_v2": _rebuild_v2,
                "_rebuild_tensor_v3": _rebuild_v3,
                "_rebuild_parameter": _rebuild_parameter,
                "_rebuild_parameter_with_state": _rebuild_parameter,
            }.get(name)
            if fn is not None:
                return fn
        if module == "torch" and name in STORAGE_DTYPES:
            return STORAGE_DTYPES[name]
        if module == "torch" and name in TORCH_DTYPES:
            return TORCH_DTYPES[name]
        if module == "torch.storage" and name == "UntypedStorage":
            return None
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: not part of a tensor state dict")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[2], str)):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r:.80}")
        _, dtype, key, _location, _numel = pid
        storage = self.storages.get(key)
        if storage is None:
            storage = self.storages[key] = _Storage(key, dtype)
        return storage


def _data_offset(f, info: zipfile.ZipInfo) -> int:
    f.seek(info.header_offset)
    local = f.read(30)
    if len(local) != 30 or local[:4] != b"PK\x03\x04":
        raise CheckpointError(f"archive record {info.filename} has a bad local header")
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    return info.header_offset + 30 + name_len + extra_len


def read_torch_zip(path: Path) -> Header:
    """Index the tensors of a ``torch.save`` zip archive at ``path`` from its pickle alone.

    Raises CheckpointError for a legacy (non-zip) file, a pickle that names anything
    but tensors, compressed or missing storage records, and views outside their storage.
    """
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"PK\x03\x04":
                raise CheckpointError(f"not a zip archive: a legacy torch file? {LEGACY_HINT}", path)
            try:
                z = zipfile.ZipFile(f)
            except zipfile.BadZipFile as e:
                raise CheckpointError(f"broken zip archive: {e}", path) from None
            records = {i.filename: i for i in z.infolist()}
            pkl = next((n for n in records if n.endswith("data.pkl") and n.count("/") == 1), None)
            if pkl is None:
                raise CheckpointError("zip archive without a data.pkl: not a torch checkpoint", path)
            prefix = pkl[: -len("data.pkl")]
            if records[pkl].file_size > MAX_PICKLE:
                raise CheckpointError(f"data.pkl is {records[pkl].file_size} bytes, above the cap", path)
            order = z.read(prefix + "byteorder").strip() if prefix + "byteorder" in records else b"little"
            if order != b"little":
                raise CheckpointError(f"byte order {order.decode(errors='replace')!r} is not supported", path)
            unpickler = _WeightsOnly(z.read(pkl))
            try:
                obj = unpickler.load()
            except (pickle.UnpicklingError, TypeError, ValueError, AttributeError, EOFError, IndexError) as e:
                raise CheckpointError(f"data.pkl refused: {e}", path) from None
            if not isinstance(obj, dict):
                raise CheckpointError(f"data.pkl holds a {type(obj).__name__}, not a state dict", path)
            starts = {}
            for key in unpickler.storages:
                info = records.get(f"{prefix}data/{key}")
                if info is None:
                    raise CheckpointError(f"storage record data/{key} is missing", path)
                if info.compress_type != zipfile.ZIP_STORED:
                    raise CheckpointError(f"storage record data/{key} is compressed; streamck reads stored ones", path)
                starts[key] = (_data_offset(f, info), info.file_size)
    except OSError as e:
        raise CheckpointError(f"cannot read: {e.strerror}", path) from None
    tensors = []
    for name, value in obj.items():
        if not isinstance(value, _Lazy):
            continue  # step counters and other non-tensor entries are not weights
        if not isinstance(name, str):
            raise CheckpointError(f"state dict key {name!r} is not a string", path)
        tensors.append(_ref(name, value, starts[value.storage.key], path))
    return Header(tensors, {}, 0)


def _ref(name: str, t: _Lazy, where: tuple[int, int], path: Path) -> TensorRef:
    start, size = where
    item = BITS[t.dtype] // 8 if t.dtype in BITS else None
    if not item or not all(type(x) is int and x >= 0 for x in (t.offset, *t.size, *t.stride)):
        raise CheckpointError(f"tensor {name!r}: unsupported dtype or bad view", path)
    if len(t.stride) != len(t.size):
        raise CheckpointError(f"tensor {name!r}: {len(t.size)} dims but {len(t.stride)} strides", path)
    numel = 1
    for d in t.size:
        numel *= d
    last = t.offset + sum((d - 1) * s for d, s in zip(t.size, t.stride, strict=True)) if numel else t.offset - 1
    if (last + 1) * item > size:
        raise CheckpointError(f"tensor {name!r}: view runs past its {size}-byte storage", path)
    first = start + t.offset * item
    contiguous, expect = True, 1
    for d, s in zip(reversed(t.size), reversed(t.stride), strict=True):
        if d != 1 and s != expect:
            contiguous = False
        expect *= d
    strides = None if contiguous or numel == 0 else t.stride
    return TensorRef(name, t.dtype, t.size, path, first, first + numel * item, strides)
