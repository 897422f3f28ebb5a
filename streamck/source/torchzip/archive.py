"""A lazy index of a PyTorch zip checkpoint (``torch.save`` since 1.6), without torch.

The archive's directory and small records are read by ranges; ``data.pkl`` is unpickled as
inert data (streamck.source.torchzip.unpickle). Tensors become references into the archive's
stored (uncompressed) storage records; views keep their offset and strides. Nested dicts and lists are read
with dotted names, as torch.distributed.checkpoint flattens them; no tensor is
left out without a notice saying so.
"""

from __future__ import annotations

import pickle
import struct
import zipfile
import zlib
from pathlib import Path

from streamck.dtypes import BITS
from streamck.errors import CheckpointError, Info, listing
from streamck.source.header import Header, TensorRef
from streamck.source.sniff import SAMPLE, looks_like
from streamck.source.torchzip import bounds
from streamck.source.torchzip.keys import select
from streamck.source.torchzip.unpickle import LEGACY_HINT, Lazy, Storage, WeightsOnly, describe
from streamck.storage import open_file

MAX_PICKLE = 256 << 20  # a state dict of 100,000 tensors pickles to ~20 MB
MAX_DEPTH = 100  # dicts and lists nested deeper are hostile (or cyclic), not a state dict
# Entries a pickled state dict flattens to, containers' included: a pickle that shares one list
# between many others (a "billion laughs") names far more than it holds. A state dict of
# 100,000 tensors with its optimizer state is about a million.
MAX_ENTRIES = 1 << 23
# A view whose elements overlap (stride 0: an expanded tensor) reads more bytes than its storage
# holds, each gathered: at most this many times the storage (or 64 MiB), not 2**80 elements.
MAX_OVERLAP = 64
MAX_SMALL_RECORD = 4096  # byteorder, version: a few bytes each
TORCH_SUFFIXES = (".bin", ".pt", ".pth")


def _read_record(z: zipfile.ZipFile, info: zipfile.ZipInfo, path: Path, cap: int) -> bytes:
    """A record's bytes, CRC-checked, at most ``cap`` of them; every way the archive can fail is
    one CheckpointError. Read to the size the directory gives, never more: ``ZipFile.read``
    inflates a deflated record whole in one call before cutting it there (a 2 MiB record of
    zeros is 2 GiB in memory)."""
    if info.flag_bits & 1:
        raise CheckpointError(f"archive record {info.filename} is encrypted", path)
    if info.file_size > cap:
        size = info.file_size
        raise CheckpointError(f"archive record {info.filename} is {size} bytes, above the {cap}-byte cap", path)
    try:
        with z.open(info) as f:
            data = f.read(info.file_size)  # each inflate step bounded by what is left to read
            if len(data) != info.file_size:
                raise EOFError(f"{len(data)} of its {info.file_size} bytes")
            return data
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"broken zip archive: cannot read {info.filename}: {e}", path) from None


def data_offset(f, info: zipfile.ZipInfo, path: Path | None = None) -> int:
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
    f, storages: dict[str, Storage], records: dict[str, zipfile.ZipInfo], prefix: str, path: Path
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
        starts[record] = (data_offset(f, info, path), info.file_size)
    return starts


def load_archive(
    f, path: Path, unpickler: type[WeightsOnly] = WeightsOnly
) -> tuple[object, dict[str, Storage], dict[str, zipfile.ZipInfo], str]:
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
    order = records.get(prefix + "byteorder")
    order = _read_record(z, order, path, MAX_SMALL_RECORD).strip() if order else b"little"
    if order != b"little":
        raise CheckpointError(f"byte order {order.decode(errors='replace')[:20]!r} is not supported", path)
    raw = _read_record(z, records[pkl], path, MAX_PICKLE)
    loader = unpickler(raw)
    try:
        bounds.check(raw)  # what it would cost, judged before the unpickler builds any of it
        obj = loader.load()
    except (pickle.UnpicklingError, TypeError, ValueError, AttributeError, EOFError, IndexError, RecursionError) as e:
        raise CheckpointError(f"data.pkl refused: {bounds.one_line(e)}", path) from None
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
                what = describe(obj) if isinstance(obj, Lazy | Storage) else f"a {type(obj).__name__}"
                raise CheckpointError(f"data.pkl holds {what}, not a state dict", path)
            starts = storage_starts(f, storages, records, prefix, path)
    except OSError as e:
        raise CheckpointError(f"cannot read: {e.strerror}", path) from None
    notices = [] if notices is None else notices
    leaves = flatten(select(obj, key, path, notices, lambda v: flatten(v, path), Lazy), path)
    tensors = [tensor_ref(n, v, starts[v.storage.key], path) for n, v in leaves.items() if isinstance(v, Lazy)]
    skipped = [n for n, v in leaves.items() if not isinstance(v, Lazy)]  # step counters, hyperparameters
    if skipped:
        notices.append(Info(f"{path.name}: skipped entries that are not tensors ({len(skipped)}): {listing(skipped)}"))
    return Header(tensors, {}, 0)


def flatten(
    obj: dict | list | tuple, path: Path, prefix: str = "", out: dict | None = None, depth: int = 0, seen=None
) -> dict:
    """Every leaf under ``obj`` by its keys and indices joined with dots, as
    torch.distributed.checkpoint's flatten_state_dict names them. At most MAX_ENTRIES entries
    are visited (``seen``: the count so far, shared down the recursion)."""
    out = {} if out is None else out
    seen = [0] if seen is None else seen
    if depth > MAX_DEPTH:
        raise CheckpointError(f"containers nested more than {MAX_DEPTH} deep under {prefix[:80]!r}", path)
    seen[0] += len(obj)
    if seen[0] > MAX_ENTRIES:
        raise CheckpointError(f"more than {MAX_ENTRIES} entries once nested containers are flattened", path)
    for k, v in obj.items() if isinstance(obj, dict) else enumerate(obj):
        if type(k) not in (str, int):
            raise CheckpointError(f"state dict key {describe(k)} is not a string or an integer", path)
        name = f"{prefix}{k}"
        if isinstance(v, dict | list | tuple):
            flatten(v, path, name + ".", out, depth + 1, seen)
        elif name in out:
            raise CheckpointError(f"two entries are named {name!r} once nested keys are joined with dots", path)
        else:
            out[name] = v
    return out


def tensor_ref(name: str, t: Lazy, where: tuple[int, int], path: Path) -> TensorRef:
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
    if strides is not None and numel * item > max(size * MAX_OVERLAP, 1 << 26):
        raise CheckpointError(
            f"tensor {name!r}: a view of {numel * item} bytes over a {size}-byte storage (its elements overlap, "
            "as an expanded tensor's do): save it with .contiguous()",
            path,
        )
    return TensorRef(name, t.dtype, t.size, path, first, first + numel * item, strides)
