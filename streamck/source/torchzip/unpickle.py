"""torch pickles read as inert data: ``data.pkl`` of a ``torch.save`` archive, unpickled with
weights-only rules. The only globals it may name are the tensor and parameter rebuilders,
storage and dtype markers, and OrderedDict; anything else (``os.system``…) is refused before it
could run. A tensor becomes a ``Lazy`` view into a ``Storage`` record, never read here.

Every torch-format family (``.bin``/``.pt``/``.ckpt``, DCP's ``.distcp``, DeepSpeed's and verl's
rank files, Megatron's args) unpickles through ``WeightsOnly`` or a subclass of it."""

from __future__ import annotations

import collections
import io
import pickle
import reprlib

from streamck.dtypes import TORCH

# The pickle names dtypes by typed storage class (``FloatStorage``) or by torch dtype
# (``float8_e4m3fn``): both read off the one table in streamck.dtypes.
STORAGE_DTYPES = {storage: name for name, (_, storage) in TORCH.items() if storage}
TORCH_DTYPES = {torch_name: name for name, (torch_name, _) in TORCH.items()}
LEGACY_HINT = "re-save it in the zip format: torch.save(torch.load(path, weights_only=True), new_path)"


class Storage:
    """A storage record: its key in the archive and the dtype it was saved with."""

    __slots__ = ("dtype", "key")

    def __init__(self, key: str, dtype: str | None):
        self.key, self.dtype = key, dtype

    def __setstate__(self, state):  # pickle's BUILD: torch's weights-only loader refuses it too
        raise pickle.UnpicklingError("a storage given pickled state")


class Lazy:
    """A tensor as the pickle describes it: a view into a storage."""

    __slots__ = ("dtype", "offset", "size", "storage", "stride")

    def __setstate__(self, state):  # pickle's BUILD: a legacy tensor.set_(), not a state dict's
        raise pickle.UnpicklingError("a tensor given pickled state (a legacy tensor layout)")

    def __init__(self, storage, offset, size, stride, dtype=None):
        if not isinstance(storage, Storage):
            raise pickle.UnpicklingError("tensor without a storage")
        self.storage, self.offset, self.size, self.stride = storage, offset, tuple(size), tuple(stride)
        self.dtype = dtype or storage.dtype
        if self.dtype is None:
            raise pickle.UnpicklingError(f"storage {storage.key} has no dtype")


# Python's own messages name these types ("'tensor' object has no attribute 'append'"):
# give them the words a user knows, never the module's internal names.
Lazy.__name__ = Lazy.__qualname__ = "tensor"
Storage.__name__ = Storage.__qualname__ = "storage"


# Named as the pickle names them, so that an argument error points at the pickle's call.
def _rebuild_tensor_v2(storage, offset, size, stride, requires_grad=False, hooks=None, metadata=None):
    return Lazy(storage, offset, size, stride)


rebuild_tensor = _rebuild_tensor_v2  # for the unpicklers that extend WeightsOnly


def _rebuild_tensor_v3(storage, offset, size, stride, requires_grad, hooks, dtype, metadata=None):
    return Lazy(storage, offset, size, stride, str(dtype))


def size(seq=()) -> tuple[int, ...]:
    """``torch.Size``: a tuple of ints, never of anything else (a reducer returning a tuple of
    what the pickle gives it could nest tuples past what streamck.source.torchzip.bounds saw)."""
    if not (isinstance(seq, list | tuple) and all(type(x) is int for x in seq)):
        raise pickle.UnpicklingError(f"torch.Size of {short(seq, 60)}")
    return tuple(seq)


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


class WeightsOnly(pickle.Unpickler):
    def __init__(self, data: bytes):
        super().__init__(io.BytesIO(data))
        self.storages: dict[str, Storage] = {}

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
            raise pickle.UnpicklingError(f"unexpected persistent id {short(pid, 80)}")
        _, dtype, key, _location, _numel = pid
        storage = self.storages.get(key)
        if storage is None:
            storage = self.storages[key] = Storage(key, dtype)
        return storage


def describe(value: object) -> str:
    """What a pickled value is, in a user's words (never this module's class names)."""
    if isinstance(value, Lazy):
        return "a tensor"
    if isinstance(value, Storage):
        return "a storage"
    return short(value, 60)


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother = 4, 60, 60


def short(value: object, width: int) -> str:
    """``repr(value)`` cut at ``width``, never built whole: a value nested a million deep, or a
    list of millions, is a few levels and items of it (``((((...),),),)``)."""
    return f"{_SHORT.repr(value):.{width}}"
