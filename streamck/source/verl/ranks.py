"""verl's FSDP rank files read as inert data: DTensors pickled whole, without torch.

``FSDPCheckpointManager`` (verl 0.9.1) ``torch.save``s each rank's sharded state dict, an
OrderedDict of HF names whose values are DTensors, for FSDP1 too (verl passes a device mesh).
A DTensor pickles as ``_rebuild_from_type_v2(_rebuild_wrapper_subclass, DTensor, (global
size, stride, …), (None, {"_local_tensor": <plain tensor>, "_spec": DTensorSpec}))``; the spec
holds the ``DeviceMesh`` (its dimension names and this rank's coordinate on each), the
placements (``Shard(dim)``, ``Replicate()``) and ``TensorMeta`` (global shape, stride, dtype).
Here those classes are stand-ins that record what was pickled (streamck.source.torchzip.inert's
``stub``), the rebuild functions never call anything, and the local tensor is a reference into
its storage record, as for any ``.pt`` file.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import NamedTuple

from streamck.errors import CheckpointError
from streamck.source.torchzip.archive import load_archive, storage_starts, tensor_ref
from streamck.source.torchzip.inert import Opaque, stub
from streamck.source.torchzip.unpickle import Lazy, WeightsOnly, rebuild_tensor, size
from streamck.storage import open_file

# The modules of DTensor's spec and mesh classes (torch 2.4 to 2.13): every class there is
# read as a stand-in that holds its constructor arguments and state.
_SPEC_MODULES = (
    "torch.distributed.tensor._dtensor_spec",
    "torch.distributed.tensor.placement_types",
    "torch.distributed._tensor.placement_types",
    "torch.distributed.device_mesh",
    "torch.distributed._mesh_layout",
)
_DTENSOR = {("torch.distributed.tensor", "DTensor"), ("torch.distributed._tensor.api", "DTensor")}


class _Marker:
    """A global the pickle names only to pass it to _rebuild_from_type_v2: calling it is refused."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, *args, **kwargs):
        raise pickle.UnpicklingError(f"{self.name} called: not part of a DTensor state dict")


_WRAPPER = _Marker("_rebuild_wrapper_subclass")
_DTENSOR_TYPE = _Marker("DTensor")


def _plain(*args):  # torch.device("cpu"), the layout: recorded, never used
    return args


class DTensor(NamedTuple):
    """A pickled DTensor: this rank's local tensor and the spec's stand-in."""

    local: Lazy
    spec: Opaque


def _rebuild_from_type_v2(func, new_type, args, state):
    """A DTensor (its local tensor and spec), or a plain tensor that carried Python attributes."""
    if func is rebuild_tensor and isinstance(args, tuple):
        return func(*args)
    if func is not _WRAPPER or new_type is not _DTENSOR_TYPE:
        raise pickle.UnpicklingError("_rebuild_from_type_v2 of something other than a tensor or a DTensor")
    if isinstance(state, tuple) and len(state) == 2:  # (dict, slots)
        state = {**(state[0] or {}), **(state[1] or {})}
    local = state.get("_local_tensor") if isinstance(state, dict) else None
    spec = state.get("_spec") if isinstance(state, dict) else None
    if not isinstance(local, Lazy) or not isinstance(spec, Opaque):
        raise pickle.UnpicklingError("a DTensor without a local tensor and a spec")
    return DTensor(local, spec)


class _VerlPickle(WeightsOnly):
    def find_class(self, module: str, name: str):
        if module == "torch._tensor" and name == "_rebuild_from_type_v2":
            return _rebuild_from_type_v2
        if module == "torch._utils" and name == "_rebuild_wrapper_subclass":
            return _WRAPPER
        if (module, name) in _DTENSOR:
            return _DTENSOR_TYPE
        if module in _SPEC_MODULES:
            return stub(module, name)
        if module == "torch" and name == "Size":
            return size
        if (module, name) in (("torch", "device"), ("torch.serialization", "_get_layout")):
            return _plain
        return super().find_class(module, name)


class RankState(NamedTuple):
    """One rank file: its state dict (DTensors, plain tensors as references, other values)."""

    path: Path
    items: dict


def read_rank(path: Path) -> RankState:
    """Unpickle the rank file at ``path`` under the allow-list; plain tensors and local shards
    become TensorRefs (checked to lie inside their storage records)."""
    try:
        with open_file(path) as f:
            if f.read(4) != b"PK\x03\x04":
                raise CheckpointError("not a zip archive (a legacy torch file?)", path)
            obj, storages, records, prefix = load_archive(f, path, _VerlPickle)
            starts = storage_starts(f, storages, records, prefix, path)
    except OSError as e:
        raise CheckpointError(f"cannot read: {e.strerror}", path) from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"data.pkl holds a {type(obj).__name__}, not a state dict", path)
    items = {}
    for name, v in obj.items():
        if not isinstance(name, str):
            raise CheckpointError(f"state dict key {name!r:.60} is not a string", path)
        if isinstance(v, DTensor):
            v = v._replace(local=tensor_ref(name, v.local, starts[v.local.storage.key], path))
        elif isinstance(v, Lazy):
            v = tensor_ref(name, v, starts[v.storage.key], path)
        items[name] = v
    return RankState(path, items)
