"""Which dict of a torch pickle is read: ``--key`` (dotted, as DCP names nested items), the
model group beside training state (streamck.source.groups), or the only dict holding tensors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from streamck.errors import CheckpointError, listing
from streamck.source.groups import ALL_KEY, is_state, model_group, model_note


def select(
    obj: dict, key: str | None, path: Path, notices: list[str], flatten: Callable[[object], dict], tensor: type
) -> dict:
    """The dict whose tensors are read: under ``key`` (dotted for nested dicts, ``state_dict.model``,
    as DCP names them; ``*``: all of ``obj``); without it, the model group beside training state
    (streamck.source.groups), or else the only top-level dict holding tensors when none sits at
    the top (either said in ``notices``, with what is left out); else ``obj``. ``flatten`` gives
    a container's leaves by dotted name, ``tensor`` is the pickle's tensor type (torchzip's: this
    module imports nothing of it)."""
    if key == ALL_KEY:
        return obj
    if key is not None:
        found, rest = _descend(obj, key)
        if rest and isinstance(found, dict | list | tuple):  # a prefix of flat names (``net.`` of ``net.0.weight``)
            head = rest + "."
            found = {n[len(head) :]: v for n, v in flatten(found).items() if n.startswith(head)} or None
        if not isinstance(found, dict) or found is obj:
            dicts = [repr(k) for k, v in obj.items() if isinstance(v, dict)]
            raise CheckpointError(f"no dict under key {key!r}; top-level dicts: {listing(dicts) or 'none'}", path)
        return found
    counts = {k: _tensors(v, flatten, tensor) for k, v in obj.items() if type(k) is str}
    group = model_group(counts)
    if group is not None and isinstance(obj[group], dict) and not any(isinstance(v, tensor) for v in obj.values()):
        left = ", ".join(f"{k} ({n} tensor{'s' * (n > 1)})" for k, n in counts.items() if n and k != group)
        # Training state that holds no tensor (plain SGD's optimizer_states) is still what was left out.
        left = left or ", ".join(k for k in counts if is_state(k)) + " (no tensors)"
        notices.append(f"{path.name}: " + model_note(group, counts[group], left))
        return obj[group]
    holders = [k for k, n in counts.items() if n and isinstance(obj[k], dict)]
    if len(holders) != 1 or any(isinstance(v, tensor) for v in obj.values()):
        return obj
    rest = {k: v for k, v in obj.items() if k != holders[0]}
    dropped = sum(isinstance(v, tensor) for v in flatten(rest).values())
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


def _tensors(value: object, flatten: Callable[[object], dict], tensor: type) -> int:
    """How many tensors ``value`` (a tensor or a container) holds."""
    if isinstance(value, dict | list | tuple):
        return sum(isinstance(v, tensor) for v in flatten(value).values())
    return int(isinstance(value, tensor))
