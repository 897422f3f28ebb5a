"""A lazy index of every tensor in a checkpoint, built from shard headers alone."""

from __future__ import annotations

import gc
import mmap
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from streamck.errors import CheckpointError
from streamck.source.header import TensorRef, read_header

INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True, slots=True)
class FileStamp:
    """What a source file looked like when indexed, to notice it changing under us."""

    size: int
    mtime_ns: int
    inode: int

    @classmethod
    def of(cls, path: Path) -> FileStamp:
        st = os.stat(path)
        return cls(st.st_size, st.st_mtime_ns, st.st_ino)


@dataclass
class Checkpoint:
    """Every tensor of a checkpoint by name (in file order), with its file, byte range, dtype and shape.

    ``root`` is the directory that holds the checkpoint (the file's directory for a
    single file); ``files`` maps each shard to the stamp taken when it was indexed.
    """

    path: Path
    root: Path
    tensors: dict[str, TensorRef]
    metadata: dict[str, str]
    files: dict[Path, FileStamp] = field(default_factory=dict)

    @property
    def total_size(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def read(self, name: str) -> memoryview:
        """Return tensor ``name``'s bytes as a read-only view of its memory-mapped shard."""
        ref = self.tensors[name]
        if ref.nbytes == 0:
            return memoryview(b"")
        with open(ref.path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return memoryview(mm)[ref.start : ref.end]

    def check_unchanged(self) -> None:
        """Raise CheckpointError if any shard changed size, mtime or inode since indexing."""
        for path, stamp in self.files.items():
            try:
                now = FileStamp.of(path)
            except OSError as e:
                raise CheckpointError(f"source vanished during the run: {e.strerror}", path) from None
            if now != stamp:
                raise CheckpointError("source file changed during the run", path)


def _load_index(index_path: Path) -> dict[str, str]:
    try:
        obj = orjson.loads(index_path.read_bytes())
    except OSError as e:
        raise CheckpointError(f"cannot read: {e.strerror}", index_path) from None
    except orjson.JSONDecodeError as e:
        raise CheckpointError(f"not valid JSON ({e})", index_path) from None
    weight_map = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError("has no 'weight_map' object of tensor name to shard file", index_path)
    return weight_map


def _shard_path(root: Path, name: str, index_path: Path) -> Path:
    rel = Path(name)
    if rel.is_absolute() or ".." in rel.parts or not rel.parts:
        raise CheckpointError(f"shard path {name!r} escapes the checkpoint directory", index_path)
    return root / rel


def _from_index(root: Path, index_path: Path) -> tuple[list[Path], dict[str, Path]]:
    """The shard files an index names, and each tensor's shard (one Path object per shard)."""
    weight_map = _load_index(index_path)
    by_name: dict[str, Path] = {}
    by_path: dict[Path, Path] = {}
    for shard in weight_map.values():
        if shard not in by_name:
            path = _shard_path(root, shard, index_path)
            if not path.is_file():
                raise CheckpointError(f"weight_map names shard {shard!r}, which does not exist", index_path)
            by_name[shard] = by_path.setdefault(path, path)
    return list(by_path), {name: by_name[shard] for name, shard in weight_map.items()}


def _layout(path: Path) -> tuple[Path, list[Path], dict[str, Path] | None]:
    """Find (root, shard files, weight_map or None) for any supported layout."""
    if path.is_file():
        return path.parent, [path], None
    if not path.is_dir():
        raise CheckpointError("no such file or directory", path)
    if (path / INDEX_NAME).is_file():
        return path, *_from_index(path, path / INDEX_NAME)
    shards = sorted(p for p in path.glob("*.safetensors") if p.is_file())
    if shards:
        return path, shards, None
    consolidated = path / "model" / "consolidated"
    if consolidated.is_dir():
        return _layout(consolidated)
    raise CheckpointError(f"no {INDEX_NAME} and no *.safetensors files here", path)


def _check_weight_map(weight_map: dict[str, Path], tensors: dict[str, TensorRef], root: Path) -> None:
    # Every tensor sits where the map says and the sizes agree: then the map is exact.
    get = weight_map.get
    if len(weight_map) == len(tensors) and all(get(t.name) is t.path for t in tensors.values()):
        return
    index_path = root / INDEX_NAME
    for name, shard in weight_map.items():
        ref = tensors.get(name)
        if ref is None or ref.path is not shard:
            where = shard.relative_to(root)
            raise CheckpointError(f"weight_map puts {name!r} in {where}, which does not hold it", index_path)
    missing = [n for n in tensors if n not in weight_map]
    shown = ", ".join(repr(n) for n in missing[:5])
    more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
    raise CheckpointError(f"shard tensors missing from weight_map: {shown}{more}", index_path)


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Index the checkpoint at ``path`` from its headers, without reading tensor data.

    ``path`` may be one ``.safetensors`` file, a directory with
    ``model.safetensors.index.json`` and its shards, a directory of
    ``*.safetensors`` shards, or a training step directory whose weights are in
    ``model/consolidated``. Raises CheckpointError for anything malformed.
    """
    path = Path(path)
    with _gc_paused():
        try:
            return _index(path)
        except OSError as e:  # stat or open of a path we may not enter or read
            raise CheckpointError(f"cannot read: {e.strerror}", e.filename or path) from None


@contextmanager
def _gc_paused() -> Iterator[None]:
    # Indexing makes ~5 objects per tensor and no cycles; the collector's passes over
    # them cost a third of the time on a 100,000-tensor checkpoint.
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _index(path: Path) -> Checkpoint:
    root, shard_paths, weight_map = _layout(path)
    tensors: dict[str, TensorRef] = {}
    metadata: dict[str, str] = {}
    files: dict[Path, FileStamp] = {}
    for shard in shard_paths:
        header = read_header(shard)
        files[shard] = FileStamp.of(shard)
        for key, value in header.metadata.items():
            metadata.setdefault(key, value)
        for ref in header.tensors:
            other = tensors.get(ref.name)
            if other is not None:
                raise CheckpointError(f"tensor {ref.name!r} is also in {other.path.name}", shard)
            tensors[ref.name] = ref
    if weight_map is not None:
        _check_weight_map(weight_map, tensors, root)
    return Checkpoint(path, root, tensors, metadata, files)
