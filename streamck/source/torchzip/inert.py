"""Objects a trainer pickles beside its tensors, read as inert stand-ins: a DeepSpeed
``ZeroStageEnum``, Lightning's ``AttributeDict``, an OmegaConf config, a DTensor's placements.
A stand-in holds what was pickled (its constructor arguments and state); nothing of it runs,
and no plain type it names (``bytes``, ``int``…) can be called from the pickle."""

from __future__ import annotations

import pickle


class Opaque:
    """An object as pickled: its constructor arguments and state; nothing of it runs."""

    def __new__(cls, *args, **kwargs):
        obj = object.__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self.state = state

    def __repr__(self):
        return f"<{type(self).__module__}.{type(self).__name__}{self.args!r}>"


def _defaultdict(factory=None, *args):
    """A defaultdict as pickled: its items, never its factory's calls (``set([...])`` takes an
    iterable of any length, but ``defaultdict(bytes, ...)`` would call it on a missing key)."""
    if args:
        raise pickle.UnpicklingError("defaultdict with arguments beyond its factory")
    return {}


_STUBS: dict[tuple[str, str], type] = {}


# Plain-data objects a trainer's client state puts into the model-states pickle (Lightning's
# DeepSpeedStrategy passes its whole checkpoint dict: hyperparameters as ``AttributeDict`` or
# ``Namespace``, or a Hydra run's OmegaConf config): read as inert stand-ins that hold what
# was pickled, like DeepSpeed's own.
DATA_ONLY = {
    ("argparse", "Namespace"): Opaque,
    ("lightning.fabric.utilities.data", "AttributeDict"): dict,
    ("lightning_fabric.utilities.data", "AttributeDict"): dict,
    ("lightning.pytorch.utilities.parsing", "AttributeDict"): dict,
    ("pytorch_lightning.utilities.parsing", "AttributeDict"): dict,
}
# Every class of these modules is a config node or its metadata; ``typing.Any`` is a node's type.
DATA_ONLY_MODULES = ("omegaconf",)
TYPING = {("typing", "Any")}
# Plain types such nodes name as values (an OmegaConf node's ``object_type``), under their
# Python 2 names too (torch.save pickles with protocol 2): stand-ins, so that no pickle can
# call them (``bytes(1 << 40)``). ``set``/``frozenset`` hold DeepSpeed's param groups, and a
# ``defaultdict`` OmegaConf's flags: the real ones, as their items come from this unpickler.
NAMED_TYPES = {"dict", "list", "tuple", "int", "float", "str", "bool", "bytes"}
PLAIN = {("builtins", "set"): set, ("builtins", "frozenset"): frozenset, ("collections", "defaultdict"): _defaultdict}


def is_data_only(module: str, name: str) -> bool:
    return (module, name) in DATA_ONLY or module.split(".", 1)[0] in DATA_ONLY_MODULES


def stub(module: str, name: str) -> type:
    cls = _STUBS.get((module, name))
    if cls is None:
        base = DATA_ONLY.get((module, name), Opaque)
        attrs = {"__module__": module, "__qualname__": name, "data_only": is_data_only(module, name)}
        cls = _STUBS[(module, name)] = type(name, (base,), attrs)
    return cls


def data_only(obj: object, depth: int = 6) -> set[str]:
    """The plain-data stand-ins (DATA_ONLY) anywhere in ``obj``, by dotted class name."""
    found = set()
    if getattr(type(obj), "data_only", False):
        found.add(f"{type(obj).__module__}.{type(obj).__name__}")
    if depth:
        kids = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
        for kid in kids:
            found |= data_only(kid, depth - 1)
    return found
