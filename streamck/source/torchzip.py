"""A lazy index of a PyTorch zip checkpoint (``torch.save`` since 1.6), without torch.

``data.pkl`` is unpickled with weights-only rules: the only globals it may name
are the tensor and parameter rebuilders, storage and dtype markers, and
OrderedDict; anything else (``os.system``…) is refused before it could run.
Tensors become references into the archive's stored (uncompressed) storage
records; views keep their offset and strides. Nested dicts and lists are read
with dotted names, as torch.distributed.checkpoint flattens them; no tensor is
left out without a notice saying so.
"""

from __future__ import annotations

import collections
import pickle
import struct
import zipfile
import zlib
from pathlib import Path

from streamck.dtypes import BITS, TORCH
from streamck.errors import CheckpointError, Info, listing
from streamck.source.header import Header, TensorRef
from streamck.source.sniff import SAMPLE, looks_like
from streamck.source.torchzip_keys import select
from streamck.storage import open_file

MAX_PICKLE = 256 << 20  # a state dict of 100,000 tensors pickles to ~20 MB
MAX_DEPTH = 100  # dicts and lists nested deeper are hostile (or cyclic), not a state dict
TORCH_SUFFIXES = (".bin", ".pt", ".pth")

# The pickle names dtypes by typed storage class (``FloatStorage``) or by torch dtype
# (``float8_e4m3fn``): both read off the one table in streamck.dtypes.
STORAGE_DTYPES = {storage: name for name, (_, storage) in TORCH.items() if storage}
TORCH_DTYPES = {torch_name: name for name, (torch_name, _) in TORCH.items()}
LEGACY_HINT = "re-save it in the zip format: torch.save(torch.load(path, weights_only=True), new_path)"


class _Storage:
    """A storage record: its key in the archive and the dtype it was saved with."""

    __slots__ = ("dtype", "key")

    def __init__(self, key: str, dtype: str | None):
        self.key, self.dtype = key, dtype

    def __setstate__(self, state):  # pickle's BUILD: torch's weights-only loader refuses it too
        raise pickle.UnpicklingError("a storage given pickled state")


class _Lazy:
    """A tensor as the pickle describes it: a view into a storage."""

    __slots__ = ("dtype", "offset", "size", "storage", "stride")

    def __setstate__(self, state):  # pickle's BUILD: a legacy tensor.set_(), not a state dict's
        raise pickle.UnpicklingError("a tensor given pickled state (a legacy tensor layout)")

    def __init__(self, storage, offset, size, stride, dtype=None):
        if not isinstance(storage, _Storage):
            raise pickle.UnpicklingError("tensor without a storage")
        self.storage, self.offset, self.size, self.stride = storage, offset, tuple(size), tuple(stride)
        self.dtype = dtype or storage.dtype
        if self.dtype is None:
            raise pickle.UnpicklingError(f"storage {storage.key} has no dtype")


# Python's own messages name these types ("'tensor' object has no attribute 'append'"):
# give them the words a user knows, never the module's internal names.
_Lazy.__name__ = _Lazy.__qualname__ = "tensor"
_Storage.__name__ = _Storage.__qualname__ = "storage"


# Named as the pickle names them, so that an argument error points at the pickle's call.
def _rebuild_tensor_v2(storage, offset, size, stride, requires_grad=False, hooks=None, metadata=None):
    return _Lazy(storage, offset, size, stride)


_rebuild_v2 = _rebuild_tensor_v2  # the name streamck.source.zero imports


def _rebuild_tensor_v3(storage, offset, size, stride, requires_grad, hooks, dtype, metadata=None):
    return _Lazy(storage, offset, size, stride, str(dtype))


def _rebuild_parameter(data, requires_grad=False, hooks=None, state=None):
    return data


class _PlainType:
    """``torch.Tensor`` or ``torch.nn.Parameter`` named as a tensor's type: a marker, never called."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


_PLAIN_TYPES = {("torch", "Tensor"): _PlainType("Tensor"), ("torch.nn.parameter", "Parameter"): _PlainType("Parameter")}
_PLAIN_VALUES = (type(None), bool, int, float, str)


def _rebuild_from_type_v2(func, new_type, args, state):
    """A plain tensor that carries Python attributes (torch's FSDP full state dict sets
    ``_has_been_cloned`` on each): the tensor, its attributes dropped. Only a plain tensor or
    parameter rebuilt by the tensor rebuilders, with a dict of plain values (or torch's
    ``(dict, slots)`` pair of them); a subclass (DTensor…) is refused before it is named."""
    if func not in (_rebuild_tensor_v2, _rebuild_tensor_v3, _rebuild_parameter) or not isinstance(new_type, _PlainType):
        raise pickle.UnpicklingError("a tensor subclass, not a plain tensor with attributes")
    if not isinstance(args, tuple):
        raise pickle.UnpicklingError("tensor rebuilt from arguments that are not a tuple")
    tensor = func(*args)
    parts = state if isinstance(state, tuple) and len(state) == 2 else (state,)
    for part in parts:
        if part is not None and not (isinstance(part, dict) and _plain(part)):
            raise pickle.UnpicklingError(f"tensor attributes {part!r:.60} are not a dict of plain values")
    return tensor


def _plain(attrs: dict) -> bool:
    return all(type(k) is str and type(v) in _PLAIN_VALUES for k, v in attrs.items())


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
                "_rebuild_tensor_v2": _rebuild_tensor_v2,
                "_rebuild_tensor_v3": _rebuild_tensor_v3,
                "_rebuild_parameter": _rebuild_parameter,
                "_rebuild_parameter_with_state": _rebuild_parameter,
            }.get(name)
            if fn is not None:
                return fn
        if module == "torch._tensor" and name == "_rebuild_from_type_v2":
            return _rebuild_from_type_v2
        if (module, name) in _PLAIN_TYPES:
            return _PLAIN_TYPES[module, name]
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


def _describe(value: object) -> str:
    """What a pickled value is, in a user's words (never this module's class names)."""
    if isinstance(value, _Lazy):
        return "a tensor"
    if isinstance(value, _Storage):
        return "a storage"
    return f"{value!r:.60}"


def _read_record(z: zipfile.ZipFile, info: zipfile.ZipInfo, path: Path) -> bytes:
    """A small record's bytes, CRC-checked; every way the archive can fail is one CheckpointError."""
    if info.flag_bits & 1:
        raise CheckpointError(f"archive record {info.filename} is encrypted", path)
    try:
        return z.read(info)
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"broken zip archive: cannot read {info.filename}: {e}", path) from None


def _data_offset(f, info: zipfile.ZipInfo, path: Path | None = None) -> int:
    """Where record ``info``'s bytes start in ``f``: past its local header, which must agree
    with the central directory and not be encrypted."""
    f.seek(info.header_offset)
    local = f.read(30)
    if len(local) != 30 or local[:4] != b"PK\x03\x04":
        raise CheckpointError(f"archive record {info.filename} has a bad local header", path)
    if info.flag_bits & 1 or local[6] & 1:
        raise CheckpointError(f"archive record {info.filename} is encrypted", path)
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    if name_len != len(info.orig_filename.encode()):
        raise CheckpointError(f"archive record {info.filename}: local header and central directory disagree", path)
    return info.header_offset + 30 + name_len + extra_len


def storage_starts(
    f, storages: dict[str, _Storage], records: dict[str, zipfile.ZipInfo], prefix: str, path: Path
) -> dict[str, tuple[int, int]]:
    """Each storage's (data start in ``f``, size): load_archive's storages located. Raises
    CheckpointError for a missing, compressed or encrypted storage record."""
    starts = {}
    for record in storages:
        info = records.get(f"{prefix}data/{record}")
        if info is None:
            raise CheckpointError(f"storage record data/{record} is missing", path)
        if info.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(f"storage record data/{record} is compressed; streamck reads stored ones", path)
        starts[record] = (_data_offset(f, info, path), info.file_size)
    return starts


def load_archive(
    f, path: Path, unpickler: type[_WeightsOnly] = _WeightsOnly
) -> tuple[object, dict[str, _Storage], dict[str, zipfile.ZipInfo], str]:
    """Unpickle the ``data.pkl`` of the torch.save archive in the open file ``f`` under
    ``unpickler``'s allow-list: (the object, its storages by key, the archive's records
    by name, the records' folder). Every way the archive can be malformed (not a zip, no
    data.pkl, too large a pickle, big-endian, a bad CRC, a refused pickle) is one
    CheckpointError naming ``path``; where the storages' bytes lie is the caller's."""
    try:
        z = zipfile.ZipFile(f)
    except (zipfile.BadZipFile, ValueError, NotImplementedError, EOFError, struct.error) as e:
        raise CheckpointError(f"broken zip archive: {e}", path) from None
    records = {i.filename: i for i in z.infolist()}
    pkl = next((n for n in records if n.endswith("data.pkl") and n.count("/") == 1), None)
    if pkl is None:
        raise CheckpointError("is a zip archive without a data.pkl: not a torch checkpoint, nor safetensors", path)
    prefix = pkl[: -len("data.pkl")]
    if records[pkl].file_size > MAX_PICKLE:
        raise CheckpointError(f"data.pkl is {records[pkl].file_size} bytes, above the cap", path)
    order = (
        _read_record(z, records[prefix + "byteorder"], path).strip() if prefix + "byteorder" in records else b"little"
    )
    if order != b"little":
        raise CheckpointError(f"byte order {order.decode(errors='replace')!r} is not supported", path)
    loader = unpickler(_read_record(z, records[pkl], path))
    try:
        obj = loader.load()
    except (pickle.UnpicklingError, TypeError, ValueError, AttributeError, EOFError, IndexError) as e:
        raise CheckpointError(f"data.pkl refused: {e}", path) from None
    return obj, loader.storages, records, prefix


def read_torch_zip(path: Path, key: str | None = None, notices: list[str] | None = None) -> Header:
    """Index the tensors of a ``torch.save`` zip archive at ``path`` from its pickle alone.

    Tensors in nested dicts, lists and tuples get dotted names (``sub.x``, ``lst.0``).
    ``key`` reads only the dict under that top-level key; without it, when no tensor sits
    at the top and exactly one top-level dict holds tensors (Lightning's ``state_dict``),
    that one is read. Lines for the user go to ``notices``: the key so chosen, and the
    entries left out because they are not tensors.

    Raises CheckpointError for a legacy (non-zip) file, a pickle that names anything
    but tensors, compressed or missing storage records, views outside their storage,
    a missing ``key``, and two entries whose dotted names are the same.
    """
    try:
        with open_file(path) as f:
            if f.read(4) != b"PK\x03\x04":
                f.seek(0)
                what = looks_like(f.read(SAMPLE))
                if what is None or what.startswith("a pickle"):
                    raise CheckpointError(f"not a zip archive: a legacy torch file? {LEGACY_HINT}", path)
                raise CheckpointError(f"is not a torch checkpoint (a zip archive): it looks like {what}", path)
            obj, storages, records, prefix = load_archive(f, path)
            if not isinstance(obj, dict):
                what = _describe(obj) if isinstance(obj, _Lazy | _Storage) else f"a {type(obj).__name__}"
                raise CheckpointError(f"data.pkl holds {what}, not a state dict", path)
            starts = storage_starts(f, storages, records, prefix, path)
    except OSError as e:
        raise CheckpointError(f"cannot read: {e.strerror}", path) from None
    notices = [] if notices is None else notices
    leaves = _flatten(select(obj, key, path, notices, lambda v: _flatten(v, path), _Lazy), path)
    tensors = [_ref(n, v, starts[v.storage.key], path) for n, v in leaves.items() if isinstance(v, _Lazy)]
    skipped = [n for n, v in leaves.items() if not isinstance(v, _Lazy)]  # step counters, hyperparameters
    if skipped:
        notices.append(Info(f"{path.name}: skipped entries that are not tensors ({len(skipped)}): {listing(skipped)}"))
    return Header(tensors, {}, 0)


def _flatten(obj: dict | list | tuple, path: Path, prefix: str = "", out: dict | None = None, depth: int = 0) -> dict:
    """Every leaf under ``obj`` by its keys and indices joined with dots, as
    torch.distributed.checkpoint's flatten_state_dict names them."""
    out = {} if out is None else out
    if depth > MAX_DEPTH:
        raise CheckpointError(f"containers nested more than {MAX_DEPTH} deep under {prefix[:80]!r}", path)
    for k, v in obj.items() if isinstance(obj, dict) else enumerate(obj):
        if type(k) not in (str, int):
            raise CheckpointError(f"state dict key {_describe(k)} is not a string or an integer", path)
        name = f"{prefix}{k}"
        if isinstance(v, dict | list | tuple):
            _flatten(v, path, name + ".", out, depth + 1)
        elif name in out:
            raise CheckpointError(f"two entries are named {name!r} once nested keys are joined with dots", path)
        else:
            out[name] = v
    return out


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
