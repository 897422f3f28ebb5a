"""A lazy index of every tensor in a checkpoint, built from shard headers alone."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from streamck.errors import CheckpointError, listing
from streamck.source.header import Header, TensorRef, read_header
from streamck.source.layout import Layout, find_layout, pick_step
from streamck.source.torchzip import TORCH_SUFFIXES, read_torch_zip


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

    def read(self, name: str) -> bytes:
        """Tensor ``name``'s bytes in row-major order (the whole tensor, in memory: for
        bounded reads use streamck.source.reader.Reader)."""
        from streamck.source.reader import Reader

        with Reader() as reader:
            return reader.read(self.tensors[name])

    def check_unchanged(self) -> None:
        """Raise CheckpointError if any shard changed size, mtime or inode since indexing."""
        for path, stamp in self.files.items():
            try:
                now = FileStamp.of(path)
            except OSError as e:
                raise CheckpointError(f"source vanished during the run: {e.strerror}", path) from None
            if now != stamp:
                raise CheckpointError("source file changed during the run", path)


def _map_error(
    layout: Layout, tensors: dict[str, TensorRef], shard: Path | None = None, names: list[str] = ()
) -> CheckpointError:
    """What is wrong between the index's weight_map and the shards (known to disagree):
    in ``shard`` just read, holding ``names``, or, after all shards, anywhere."""
    if shard is not None:
        missing = [n for n in names if n not in layout.weight_map]
        if missing:
            shown = listing([repr(n) for n in missing], 5)
            return CheckpointError(f"shard tensors missing from weight_map: {shown}", layout.index)
        name = next(n for n in names if layout.weight_map[n] not in layout.spellings[shard])
        return CheckpointError(
            f"weight_map puts {name!r} in {layout.weight_map[name]}, but it is in {shard.relative_to(layout.root)}",
            layout.index,
        )
    for name, shard_name in layout.weight_map.items():
        ref = tensors.get(name)
        if ref is None:
            return CheckpointError(f"weight_map puts {name!r} in {shard_name}, which does not hold it", layout.index)
    raise AssertionError("weight_map and shards agree")


def open_checkpoint(path: str | os.PathLike, step: str | int | None = None) -> Checkpoint:
    """Index the checkpoint at ``path`` from its headers, without reading tensor data.

    ``path`` may be one ``.safetensors`` file or torch zip (``.bin``/``.pt``), a
    directory with ``model.safetensors.index.json`` or ``pytorch_model.bin.index.json``
    and its shards, a directory of ``*.safetensors`` or ``pytorch_model*.bin`` shards,
    a step directory whose weights are in ``model/consolidated``, or, with ``step``
    (a number or ``"latest"``), a run root of ``checkpoint-<step>`` folders.
    Raises CheckpointError for anything malformed.
    """
    path = Path(path)
    if step is not None:
        path = pick_step(path, step)
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


def _read_shard(path: Path) -> Header:
    if path.suffix == ".safetensors":
        return read_header(path)
    if path.suffix in TORCH_SUFFIXES:
        return read_torch_zip(path)
    with open(path, "rb") as f:  # any other name: the first bytes decide
        zipped = f.read(4) == b"PK\x03\x04"
    return read_torch_zip(path) if zipped else read_header(path)


def _index(path: Path) -> Checkpoint:
    layout = find_layout(path)
    tensors: dict[str, TensorRef] = {}
    metadata: dict[str, str] = {}
    files: dict[Path, FileStamp] = {}
    for shard in layout.shards:
        files[shard] = FileStamp.of(shard)  # before reading: a change while we read shows too
        header = _read_shard(shard)
        for key, value in header.metadata.items():
            metadata.setdefault(key, value)
        names = [ref.name for ref in header.tensors]
        if not tensors.keys().isdisjoint(names):
            name = next(n for n in names if n in tensors)
            raise CheckpointError(f"tensor {name!r} is also in {tensors[name].path.name}", shard)
        tensors.update(zip(names, header.tensors, strict=True))
        # Each of this shard's tensors is mapped to this shard (one C-level pass)...
        if layout.weight_map is not None and not set(map(layout.weight_map.get, names)) <= layout.spellings[shard]:
            raise _map_error(layout, tensors, shard, names)
    # ...and the map names nothing else: then it is exact.
    if layout.weight_map is not None and len(layout.weight_map) != len(tensors):
        raise _map_error(layout, tensors)
    return Checkpoint(path, layout.root, tensors, metadata, files)
