"""The lazy index every source reader builds: per tensor, its file, byte runs, dtype and shape."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from streamck.dtypes import nbytes
from streamck.errors import CheckpointError
from streamck.source.header import TensorRef
from streamck.storage import UrlPath, stamp


@dataclass(frozen=True, slots=True)
class FileStamp:
    """What a source file looked like when indexed, to notice it changing under us."""

    size: int
    mtime_ns: int
    inode: int | str  # a remote object's ETag

    @classmethod
    def of(cls, path: Path) -> FileStamp:
        if isinstance(path, UrlPath):
            return cls(*stamp(path))
        st = os.stat(path)
        return cls(st.st_size, st.st_mtime_ns, st.st_ino)


@dataclass
class Checkpoint:
    """Every tensor of a checkpoint by name (in file order), with its file, byte range, dtype and shape.

    ``root`` is the directory that holds the checkpoint (the file's directory for a
    single file); ``files`` maps each shard to the stamp taken when it was indexed;
    ``notices`` are lines a user should see (items skipped as not tensors, the sub-dict
    of a torch pickle read): the library never prints them;
    ``side_root`` holds the config and tokenizer files (``root`` when None).
    """

    path: Path
    root: Path
    tensors: dict[str, TensorRef]
    metadata: dict[str, str]
    files: dict[Path, FileStamp] = field(default_factory=dict)
    notices: list[str] = field(default_factory=list)
    side_root: Path | None = None

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
        for path, was in self.files.items():
            try:
                now = FileStamp.of(path)
            except OSError as e:
                raise CheckpointError(f"source vanished during the run: {e.strerror}", path) from None
            if now != was:
                raise CheckpointError("source file changed during the run", path)


def tiled(entries: dict, root: Path) -> tuple[dict[str, TensorRef], list[Path]]:
    """References of tensors read as tiles (DCP chunks, ZeRO fragments), and every file
    their tiles lie in."""
    tensors = {e.name: tiled_ref(e, root) for e in entries.values()}
    return tensors, list(dict.fromkeys(t.path for e in entries.values() for t in e.tiles))


def tiled_ref(e, root: Path) -> TensorRef:
    """A tiled entry's reference; a DCP tensor saved whole as a strided view is a view,
    gathered as a ``.pt`` file's views are."""
    size = nbytes(e.dtype, math.prod(e.shape))
    strides = getattr(e, "strides", None)  # ZeRO's entries have none
    if strides is not None:
        return TensorRef(e.name, e.dtype, e.shape, e.tiles[0].path, e.tiles[0].start, e.tiles[0].start + size, strides)
    return TensorRef(e.name, e.dtype, e.shape, e.tiles[0].path if e.tiles else root, 0, size, None, e.tiles)


def not_empty(ckpt: Checkpoint, what: str) -> Checkpoint:
    """A training-format source (DCP, Automodel, ZeRO) that yields no tensor is an error, never an
    empty output: its notices say why (non-tensor items only, flatten_state_dict=False)."""
    if not ckpt.tensors:
        why = "; ".join(ckpt.notices)
        raise CheckpointError(f"no tensors in this {what} checkpoint" + (f" ({why})" if why else ""), ckpt.root)
    return ckpt
