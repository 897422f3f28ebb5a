"""Native DCP files as torch's FileSystemWriter lays them out, without torch.

A ``__N_0.distcp`` file is its items one after another, each a ``torch.save`` archive: a chunk
of a tensor (``torch.save(chunk)``) or a bytes item (``torch.save([object])``, megatron-core's
ShardedObject). ``.metadata`` is a pickle of torch's ``Metadata``: per tensor its dtype, global
shape and chunks (``TensorStorageMetadata``), per bytes item a ``BytesStorageMetadata``, and
``storage_data``, where each chunk's or item's archive lies (``MetadataIndex`` to
``_StorageInfo``: file, offset, length). FileSystemReader.read_data reads each archive from
there and ``torch.load``s it (torch/distributed/checkpoint/filesystem.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from streamck.dtypes import TORCH
from streamck.plan import OutputTensor
from streamck.writer.formats.megatron.pickles import Call, Global, New, Pairs, dumps, size

META = "torch.distributed.checkpoint.metadata"
VERSION = "1.0.0"  # Metadata.version as megatron-core 0.19.2 on torch 2.x saves it


class Chunk(NamedTuple):
    """Where one chunk lies in its tensor: the tensor's key, dtype and global shape, the chunk's offsets and sizes."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


class Piece(NamedTuple):
    """One chunk and what fills it: an output tensor's bytes, or zeros (None)."""

    chunk: Chunk
    tensor: OutputTensor | None


class Item(NamedTuple):
    """One archive in a .distcp file: the bytes before its data, ``data`` bytes of data (the shard's
    tensor ``tensor``, or zeros where that is None), the bytes after; ``chunk`` for a tensor's
    chunk, else ``fqn`` names a bytes item."""

    fqn: str
    before: bytes
    after: bytes
    data: int = 0
    tensor: int | None = None
    chunk: Chunk | None = None

    @property
    def length(self) -> int:
        return len(self.before) + self.data + len(self.after)


def _properties(dtype: str) -> New:
    """``TensorProperties(dtype)``, pickled as its ``__getstate__`` tuple (dtype, layout,
    requires_grad, memory format, pin_memory)."""
    layout = Call(Global("torch.serialization", "_get_layout"), ("torch.strided",))
    memory = Call(Global(META, "_MEM_FORMAT_ENCODING"), (0,))  # TORCH_CONTIGUOUS_FORMAT
    return New(Global(META, "TensorProperties"), (Global("torch", TORCH[dtype][0]), layout, False, memory, False))


def _storage_info(path: str, offset: int, length: int) -> New:
    fields = {"relative_path": path, "offset": offset, "length": length}
    return New(Global("torch.distributed.checkpoint.filesystem", "_StorageInfo"), fields)


def _index(fqn: str, offsets: tuple[int, ...] | None) -> New:
    return New(
        Global(META, "MetadataIndex"), {"fqn": fqn, "offset": None if offsets is None else size(offsets), "index": None}
    )


def metadata(files: Sequence[tuple[str, Sequence[Item]]]) -> bytes:
    """``.metadata`` for ``files`` (each a name and its items in order)."""
    tensors: dict[str, tuple[Chunk, list[New]]] = {}
    objects: dict[str, New] = {}
    where = []
    for name, items in files:
        offset = 0
        for item in items:
            c = item.chunk
            if c is None:
                objects[item.fqn] = New(Global(META, "BytesStorageMetadata"), {})
            else:
                entry = tensors.setdefault(c.key, (c, []))  # its dtype is every chunk's: table._one_dtype
                entry[1].append(
                    New(Global(META, "ChunkStorageMetadata"), {"offsets": size(c.offsets), "sizes": size(c.sizes)})
                )
            where.append((_index(item.fqn, None if c is None else c.offsets), _storage_info(name, offset, item.length)))
            offset += item.length
    state = {}
    for key, (c, chunks) in tensors.items():
        fields = {"properties": _properties(c.dtype), "size": size(c.shape), "chunks": chunks}
        state[key] = New(Global(META, "TensorStorageMetadata"), fields)
    state.update(objects)
    fields = {"state_dict_metadata": state, "planner_data": None, "storage_data": Pairs(where), "storage_meta": None,
              "version": VERSION}  # fmt: skip
    return dumps(New(Global(META, "Metadata"), fields))
