"""Native DCP's ``.metadata``, without torch: which chunk of which tensor lies where.

``.metadata`` (or, for a save made with ``use_collectives=False``, one ``__R.metadata``
per rank, each naming only that rank's chunks) is a pickle of torch's ``Metadata``, read
here with an allow-list of stand-in classes. The save plans that megatron-core keeps in
``Metadata.all_local_plans`` (``SavePlan``, ``WriteItem``…) are read as inert data;
paths (``pathlib._local.PosixPath`` on Python 3.13) as inert paths.
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path, PurePosixPath
from typing import NamedTuple

from streamck.errors import CheckpointError
from streamck.source.dcp.sharded import int_tuple
from streamck.source.torchzip import bounds
from streamck.source.torchzip.archive import MAX_PICKLE
from streamck.source.torchzip.unpickle import TORCH_DTYPES
from streamck.storage import open_file

METADATA_FILE = ".metadata"
_RANK_METADATA = re.compile(r"__(\d+)\.metadata")


class _Stub:
    """A DCP dataclass: pickle's BUILD fills ``__dict__`` from the saved state; an enum
    (``WriteItemType``) is called with its value, kept in ``args``."""

    def __init__(self, *args):
        self.args = args

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


class _Inert(_Stub):
    """Recorded, never used: storage metadata, save plans and their items."""


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
    value = int_tuple(seq)
    if value is None or len(args) > 1:
        raise pickle.UnpicklingError(f"torch.Size of {seq!r:.60}")
    return value


def _plain(*args):  # layouts, memory-format codes, paths: recorded, never used
    return args


_PATHS = ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")
# module -> {name: stand-in}: what torch 2.13's FileSystemWriter, megatron-core and OLMo-core pickle
# (see pickletools on real files), nothing else.
_ALLOWED: dict[str, dict[str, object]] = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata": _Metadata,
        "TensorStorageMetadata": _TensorStorage,
        "BytesStorageMetadata": _BytesStorage,
        "ChunkStorageMetadata": _Chunk,
        "TensorProperties": _TensorProperties,
        "MetadataIndex": _Index,
        "StorageMeta": _Inert,
        "_MEM_FORMAT_ENCODING": _plain,
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo": _StorageInfo, "_StoragePrefix": _Inert},
    # OLMo-core 3.0's own FileSystemWriter pickles its copy of the class (same fields)
    "olmo_core.distributed.checkpoint.filesystem": {"_StorageInfo": _StorageInfo, "_StoragePrefix": _Inert},
    # megatron-core's Metadata.all_local_plans: every rank's save plan, data only
    "torch.distributed.checkpoint.planner": dict.fromkeys(
        ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData"), _Inert
    ),
    "megatron.core.dist_checkpointing.strategies.torch": {"MCoreSavePlan": _Inert},
    "torch": {"Size": _size},
    "torch.serialization": {"_get_layout": _plain},
    "pathlib": dict.fromkeys(_PATHS, _plain),
    "pathlib._local": dict.fromkeys(_PATHS, _plain),  # Python 3.13 (CPython issue 133789)
    "collections": {"OrderedDict": dict},
}
_DTYPE_NAME = re.compile(r"(u?int\d+|float\d+\w*|bfloat16|complex\d+|bool|q(u?int)\w+|bits\w+)")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        found = _ALLOWED.get(module, {}).get(name)
        if found is not None:
            return found
        if module == "torch" and _DTYPE_NAME.fullmatch(name):
            return _TorchDtype(name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: not part of DCP metadata")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("persistent id in DCP metadata")


def _load(path: Path) -> _Metadata:
    try:
        with open_file(path) as f:
            raw = f.read(MAX_PICKLE + 1)
    except OSError as e:
        raise CheckpointError(f"cannot read: {e.strerror}", path) from None
    if len(raw) > MAX_PICKLE:
        raise CheckpointError(f"above the {MAX_PICKLE}-byte cap", path)
    try:
        bounds.check(raw, bounds.MAX_METADATA_OPCODES)  # judged before the unpickler builds any of it
        md = _MetadataUnpickler(io.BytesIO(raw)).load()
    except (
        pickle.UnpicklingError,
        TypeError,
        ValueError,
        AttributeError,
        EOFError,
        IndexError,
        KeyError,
        RecursionError,
    ) as e:
        raise CheckpointError(f"refused: {bounds.one_line(e)}", path) from None
    if not isinstance(md, _Metadata):
        raise CheckpointError(f"holds a {type(md).__name__}, not DCP Metadata", path)
    if not isinstance(getattr(md, "state_dict_metadata", None), dict):
        raise CheckpointError("Metadata has no state_dict_metadata map", path)
    if not isinstance(getattr(md, "storage_data", None), dict):
        raise CheckpointError("Metadata has no storage_data map (not written by FileSystemWriter?)", path)
    return md


def metadata_paths(directory: Path) -> list[Path]:
    """``.metadata``, or else every ``__R.metadata`` (ranks 0..N-1, none missing).

    torch's own loader reads ``.metadata`` when it is there, as here."""
    if (directory / METADATA_FILE).is_file():
        return [directory / METADATA_FILE]
    ranks = {int(m.group(1)): p for p in directory.iterdir() if (m := _RANK_METADATA.fullmatch(p.name))}
    if not ranks:
        shards = "*.distcp files, but" if any(directory.glob("*.distcp")) else "no"
        raise CheckpointError(
            f"{shards} no .metadata: a native DCP checkpoint needs its hidden .metadata file "
            "(copy the directory itself; `cp dir/*` leaves it behind)",
            directory,
        )
    missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
    if missing:
        names = ", ".join(f"__{r}.metadata" for r in missing[:4])
        raise CheckpointError(f"per-rank metadata {names} missing (have ranks {sorted(ranks)})", directory)
    return [ranks[r] for r in sorted(ranks)]


def _relative(rel: object, directory: Path, md_path: Path) -> Path:
    if not isinstance(rel, str) or not rel:
        raise CheckpointError(f"storage record names file {rel!r:.60}", md_path)
    pure = PurePosixPath(rel)
    if pure.is_absolute() or ".." in pure.parts or "\\" in rel:
        raise CheckpointError(f"storage record names {rel!r}, outside the checkpoint directory", md_path)
    return directory / rel


class Location(NamedTuple):
    """A blob: ``length`` bytes of ``path`` from ``offset``, a whole torch.save archive."""

    path: Path
    offset: int
    length: int
    transforms: object = None  # _StorageInfo.transform_descriptors: absent unless an extension was used


def _storage_map(md: _Metadata, directory: Path, md_path: Path) -> dict[tuple[str, tuple[int, ...] | None], Location]:
    out: dict[tuple[str, tuple[int, ...] | None], Location] = {}
    for index, info in md.storage_data.items():
        if not isinstance(index, _Index) or not isinstance(info, _StorageInfo):
            raise CheckpointError("storage_data is not a map of MetadataIndex to _StorageInfo", md_path)
        fqn, offset = getattr(index, "fqn", None), getattr(index, "offset", None)
        if not isinstance(fqn, str):
            raise CheckpointError(f"storage record with fqn {fqn!r:.60}", md_path)
        start, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (type(start) is int and type(length) is int and start >= 0 and length >= 0):
            raise CheckpointError(f"{fqn!r}: storage record range {start!r}, {length!r}", md_path)
        key = (fqn, None if offset is None else int_tuple(offset))
        if key in out:
            raise CheckpointError(f"{fqn!r}: two storage records for the chunk at {offset}", md_path)
        rel = _relative(getattr(info, "relative_path", None), directory, md_path)
        out[key] = Location(rel, start, length, getattr(info, "transform_descriptors", None))
    _short_records(out, md_path)
    return out


MIN_BLOB = 22  # a zip's end record alone: no torch.save archive (every blob is one) is shorter


def _short_records(where: dict[tuple[str, tuple[int, ...] | None], Location], md_path: Path) -> None:
    """Refuse storage records shorter than any archive: native._disjoint refuses records that
    share bytes, but records of no bytes share none, and a .metadata could name a million of
    them (each read on its own, a few hundred µs apiece) backed by no file at all."""
    for (fqn, _), loc in where.items():
        if loc.length < MIN_BLOB:
            raise CheckpointError(f"{fqn!r}: a {loc.length}-byte storage record, shorter than any archive", md_path)


class Chunk(NamedTuple):
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    where: Location


class TensorItem(NamedTuple):
    dtype: str
    shape: tuple[int, ...]
    chunks: list[Chunk]


class Saved(NamedTuple):
    """A DCP checkpoint's items, every rank's metadata merged, in save-plan order."""

    tensors: dict[str, TensorItem]
    objects: dict[str, Location | None]  # non-tensor items (BytesStorageMetadata)
    flattened: bool  # saved with flatten_state_dict (the default): no tensors inside objects
    where: Path  # .metadata, or the directory for per-rank metadata (for messages)


def read_metadata(directory: Path) -> Saved:
    """Every item of the DCP checkpoint in ``directory``, with where its chunks are.

    Per-rank metadata (``use_collectives=False``) is merged: a chunk that several ranks
    saved (a replicated tensor, which no global plan deduplicated) is read from the lowest rank.
    """
    paths = metadata_paths(directory)
    saved = Saved({}, {}, True, paths[0] if len(paths) == 1 else directory)
    for md_path in paths:
        md = _load(md_path)
        where = _storage_map(md, directory, md_path)
        if getattr(md, "planner_data", None) is None:
            saved = saved._replace(flattened=False)
        for name, meta in md.state_dict_metadata.items():
            if not isinstance(name, str):
                raise CheckpointError(f"state dict key {name!r:.60} is not a string", md_path)
            if isinstance(meta, _BytesStorage):
                saved.objects.setdefault(name, where.get((name, None)))
            elif isinstance(meta, _TensorStorage):
                _add_tensor(saved.tensors, name, meta, where, md_path)
            else:
                raise CheckpointError(f"{name!r}: storage metadata is a {type(meta).__name__}", md_path)
    return saved


def _add_tensor(tensors: dict[str, TensorItem], name: str, meta: _TensorStorage, where: dict, md_path: Path) -> None:
    raw = getattr(getattr(meta, "properties", None), "dtype", None)
    dtype = TORCH_DTYPES.get(raw.name) if isinstance(raw, _TorchDtype) else None
    if dtype is None:
        shown = f"torch.{raw.name}" if isinstance(raw, _TorchDtype) else repr(raw)
        raise CheckpointError(f"tensor {name!r}: unknown or unsupported dtype {shown}", md_path)
    shape = int_tuple(getattr(meta, "size", None))
    chunks = getattr(meta, "chunks", None)
    if shape is None or not isinstance(chunks, list) or not all(isinstance(c, _Chunk) for c in chunks):
        raise CheckpointError(f"tensor {name!r}: malformed size or chunk list", md_path)
    item = tensors.setdefault(name, TensorItem(dtype, shape, []))
    if (item.dtype, item.shape) != (dtype, shape):
        raise CheckpointError(
            f"tensor {name!r} is {dtype} {list(shape)} here, "
            f"{item.dtype} {list(item.shape)} in another rank's metadata",
            md_path,
        )
    have = {c.offsets: c.sizes for c in item.chunks}
    for c in chunks:
        offsets, sizes = int_tuple(getattr(c, "offsets", None)), int_tuple(getattr(c, "sizes", None))
        if offsets is None or sizes is None or len(offsets) != len(sizes):
            raise CheckpointError(f"tensor {name!r}: chunk with offsets/sizes {offsets}/{sizes}", md_path)
        if have.get(offsets) == sizes:
            continue  # the same chunk from a lower rank (per-rank metadata only: one file has no duplicates)
        loc = where.get((name, offsets))
        if loc is None:
            raise CheckpointError(f"tensor {name!r}: no storage record for the chunk at {offsets}", md_path)
        if loc.transforms:
            raise CheckpointError(
                f"tensor {name!r} is stored through transforms {list(loc.transforms)}: "
                "streamck reads untransformed chunks only",
                md_path,
            )
        item.chunks.append(Chunk(offsets, sizes, loc))
