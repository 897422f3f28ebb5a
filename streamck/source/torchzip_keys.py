"""Which dict of a torch pickle is read: ``--key`` (dotted, as DCP names nested items), the
model group beside training state (streamck.source.groups), or the only dict holding tensors."""

from __future__ import annotations

from pathlib import Path

from streamck.errors import CheckpointError, listing
from streamck.source.groups import ALL_KEY, model_group, model_note
from streamck.source.torchzip import _flatten, _Lazy


def select(obj: dict, key: str | None, path: Path, notices: list[str]) -> dict:
    """The dict whose tensors are read: under ``key`` (dotted for nested dicts, ``state_dict.model``,
    as DCP names them; ``*``: all of ``obj``); without it, the model group beside training state
    (streamck.source.groups), or else the only top-level dict holding tensors when none sits at
    the top (either said in ``notices``, with what is left out); else ``obj``."""
    if key == ALL_KEY:
        return obj
    if key is not None:
        found, rest = _descend(obj, key)
        if rest and isinstance(found, dict | list | tuple):  # a prefix of flat names (``net.`` of ``net.0.weight``)
            head = rest + "."
            found = {n[len(head) :]: v for n, v in _flatten(found, path).items() if n.startswith(head)} or None
        if not isinstance(found, dict) or found is obj:
            dicts = [repr(k) for k, v in obj.items() if isinstance(v, dict)]
            raise CheckpointError(f"no dict under key {key!r}; top-level dicts: {listing(dicts) or 'none'}", path)
        return found
    counts = {k: _tensors(v, path) for k, v in obj.items() if type(k) is str}
    group = model_group(counts)
    if group is not None and isinstance(obj[group], dict) and not any(isinstance(v, _Lazy) for v in obj.values()):
        left = ", ".join(f"{k} ({n} tensor{'s' * (n > 1)})" for k, n in counts.items() if n and k != group)
        notices.append(f"{path.name}: " + model_note(group, counts[group], left))
        return obj[group]
    holders = [k for k, n in counts.items() if n and isinstance(obj[k], dict)]
    if len(holders) != 1 or any(isinstance(v, _Lazy) for v in obj.values()):
        return obj
    rest = {k: v for k, v in obj.items() if k != holders[0]}
    dropped = sum(isinstance(v, _Lazy) for v in _flatten(rest, path).values())
    left = f"; left out: {listing([str(k) for k in rest])}" if rest else ""
    left += f" (tensors there: {dropped})" if dropped else ""
    notices.append(f"{path.name}: read the tensors under {holders[0]!r}, the only dict holding any (see --key){left}")
    return obj[holders[0]]


def _descend(obj: object, key: str) -> tuple[object, str]:
    """How far the dotted ``key`` names entries from ``obj``: (the value reached, the rest of the
    key). Each step takes the longest run of parts that names an entry, since a name may hold
    dots itself (Lightning's ``state_dict`` is flat: ``net.0.weight``)."""
    parts = key.split(".") if key else []
    for i in range(len(parts), 0, -1):
        head, rest = ".".join(parts[:i]), ".".join(parts[i:])
        if isinstance(obj, dict) and head in obj:
            return _descend(obj[head], rest)
        if isinstance(obj, list | tuple) and head.isdigit() and int(head) < len(obj):
            return _descend(obj[int(head)], rest)
    return obj, key


def _tensors(value: object, path: Path) -> int:
    """How many tensors ``value`` (a tensor or a container) holds."""
    if isinstance(value, dict | list | tuple):
        return sum(isinstance(v, _Lazy) for v in _flatten(value, path).values())
    return int(isinstance(value, _Lazy))
