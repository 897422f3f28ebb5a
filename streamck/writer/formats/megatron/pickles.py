"""The pickles a ``torch_dist`` checkpoint holds, written without torch.

torch's classes are named, never imported: a pickle here is plain data with three stand-ins,
``Global`` (a class or function by its module and name, the GLOBAL opcode), ``New`` (an
instance made as ``cls.__new__(cls)`` and filled from its state: NEWOBJ then BUILD, as
dataclasses pickle) and ``Call`` (``func(*args)``: REDUCE), plus ``Persistent`` (a storage's
persistent id in a torch.save pickle). What they spell is what torch 2.x's own pickles hold
(checked with pickletools on real files: DCP's ``Metadata``, a ``torch.save`` of a tensor).

``archive(pkl, data_size)`` frames a ``data.pkl`` as a ``torch.save`` zip (streamck.writer.torchsave's
records) around one ``data/0`` record of ``data_size`` bytes, or none: the bytes before the data and
the bytes after it. The data record's CRC-32 is written as 0, as ``torch.save`` writes it under
``torch.serialization.set_crc32_options(False)``: torch.load does not check it, and the tensor bytes
then move kernel-side instead of through Python.
"""

from __future__ import annotations

import io
import pickle
import zlib
from typing import NamedTuple

from streamck.dtypes import BITS, TORCH
from streamck.writer.torchsave import FORMAT, TRAILER, Record, end_of_archive

ARCHIVE = "archive"  # torch.save's folder name for a stream (no file name)


class Global(NamedTuple):
    module: str
    name: str


class New(NamedTuple):
    cls: Global
    state: object


class Call(NamedTuple):
    func: Global
    args: tuple


class Persistent(NamedTuple):
    pid: tuple


class Pairs(NamedTuple):
    """A dict whose keys are stand-ins (DCP's ``storage_data``: MetadataIndex keys)."""

    items: list


class _Pickler(pickle._Pickler):  # the pure-Python pickler: its save() can be extended
    def save(self, obj, save_persistent_id=True):
        kind = type(obj)
        if kind is Global:
            self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
        elif kind is New:
            self.save(obj.cls)
            self.write(pickle.EMPTY_TUPLE + pickle.NEWOBJ)
            self.save(obj.state)
            self.write(pickle.BUILD)
        elif kind is Call:
            self.save(obj.func)
            self.save(obj.args)
            self.write(pickle.REDUCE)
        elif kind is Persistent:
            self.save(obj.pid)
            self.write(pickle.BINPERSID)
        elif kind is Pairs:
            self.write(pickle.EMPTY_DICT)
            for at in range(0, len(obj.items), 1000):  # SETITEMS in batches, as pickle does
                self.write(pickle.MARK)
                for key, value in obj.items[at : at + 1000]:
                    self.save(key)
                    self.save(value)
                self.write(pickle.SETITEMS)
        else:
            super().save(obj, save_persistent_id)


def dumps(obj: object) -> bytes:
    """``obj`` pickled (protocol 2, torch.save's), the stand-ins as what they name."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=2).dump(obj)
    return buffer.getvalue()


def size(shape: tuple[int, ...]) -> Call:
    """``torch.Size(shape)``."""
    return Call(Global("torch", "Size"), (tuple(shape),))


def tensor_pickle(dtype: str, shape: tuple[int, ...]) -> bytes:
    """``data.pkl`` of ``torch.save(t)`` for a contiguous CPU tensor ``t`` (storage ``0``)."""
    torch_name, storage = TORCH[dtype]
    numel, strides, step = 1, [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= d
    for d in shape:
        numel *= d
    if storage:
        pid, rebuild, extra = ("storage", Global("torch", storage), "0", "cpu", numel), "_rebuild_tensor_v2", ()
    else:  # dtypes without a typed storage: an untyped one of bytes, the dtype named after the hooks
        nbytes = numel * BITS[dtype] // 8
        pid = ("storage", Global("torch.storage", "UntypedStorage"), "0", "cpu", nbytes)
        rebuild, extra = "_rebuild_tensor_v3", (Global("torch", torch_name),)
    hooks = Call(Global("collections", "OrderedDict"), ())
    args = (Persistent(pid), 0, tuple(shape), tuple(reversed(strides)), False, hooks, *extra)
    return dumps(Call(Global("torch._utils", rebuild), args))


def archive(pkl: bytes, data_size: int | None) -> tuple[bytes, bytes]:
    """A ``torch.save`` zip of ``pkl`` and, unless ``data_size`` is None, one data record of that
    many bytes: (the bytes before the record's data, the bytes after it)."""
    prefix = ARCHIVE + "/"
    members = [("data.pkl", pkl), *FORMAT.items()]
    if data_size is not None:
        members.append(("data/0", None))
    members += list(TRAILER.items())
    records, offset = [], 0
    for name, data in members:
        record = Record(prefix + name, data_size if data is None else len(data), offset)
        records.append(record)
        offset += record.span
    before, after, crcs, seen_data = bytearray(), bytearray(), [], False
    for record, (_, data) in zip(records, members, strict=True):
        crc = 0 if data is None else zlib.crc32(data)
        crcs.append(crc)
        out = after if seen_data else before
        out += record.local_header()
        if data is None:
            seen_data = True
            after.extend(record.descriptor(crc))
            continue
        out += data + record.descriptor(crc)
    tail = end_of_archive(records, crcs)
    (after if seen_data else before).extend(tail)
    return bytes(before), bytes(after)


def object_bytes(value: object) -> bytes:
    """A DCP bytes item as megatron-core saves a ShardedObject: ``torch.save([value])``."""
    before, after = archive(dumps([value]), None)
    return before + after
