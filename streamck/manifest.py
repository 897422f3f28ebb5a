"""The manifest: a checkpoint's key set as stable, diff-friendly JSON.

Format (version 1)::

    {
      "format": "streamck-manifest",
      "metadata": {...},            # the header __metadata__
      "tensors": {
        "name": {"dtype": "BF16", "shape": [4096, 4096]},   # one line per tensor
        ...
      },
      "total_size": 123,            # bytes of tensor data
      "version": 1
    }

Keys are sorted everywhere. A tensor entry may carry more fields (``sha256``
in a hash manifest); readers ignore fields they do not know. A hash manifest
also has ``"files": {"model.safetensors": {"sha256": ..., "size": ...}}``, each file
the tensors are read from by its path under the checkpoint's root.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import orjson

FORMAT = "streamck-manifest"
VERSION = 1


def build_manifest(
    tensors: Iterable[tuple[str, str, tuple[int, ...], int]],
    metadata: dict[str, str],
    extra: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A manifest from ``(name, dtype, shape, nbytes)`` rows; ``extra`` adds fields per tensor."""
    entries, total, extra = {}, 0, extra or {}
    for name, dtype, shape, size in tensors:
        entries[name] = {"dtype": dtype, "shape": list(shape), **extra.get(name, {})}
        total += size
    return {
        "format": FORMAT,
        "metadata": dict(sorted(metadata.items())),
        "tensors": dict(sorted(entries.items())),
        "total_size": total,
        "version": VERSION,
    }


def _dump(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def _entry(entry: dict[str, Any]) -> str:
    # The common entry, written directly: json.dumps per tensor is most of the time
    # `ls --json` takes on a checkpoint of 100,000 tensors. Dtype names need no escaping.
    if len(entry) == 2 and type(entry.get("dtype")) is str and entry["dtype"].isidentifier():
        shape = entry.get("shape")
        if type(shape) is list and all(type(d) is int for d in shape):
            return f'{{"dtype": "{entry["dtype"]}", "shape": [{", ".join(map(str, shape))}]}}'
    return _dump(entry)


def dumps(manifest: dict[str, Any]) -> str:
    """Render with sorted keys, two-space indent, and each tensor on one line."""
    dump = _dump
    lines = ["{"]
    keys = sorted(manifest)
    for i, key in enumerate(keys):
        comma = "," if i < len(keys) - 1 else ""
        value = manifest[key]
        if key in ("tensors", "files") and value:
            lines.append(f"  {dump(key)}: {{")
            rows = sorted(value.items())
            lines += [f"    {orjson.dumps(n).decode()}: {_entry(e)}," for n, e in rows]  # = json.dumps here
            lines[-1] = lines[-1][:-1]
            lines.append(f"  }}{comma}")
        else:
            lines.append(f"  {dump(key)}: {dump(value)}{comma}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def checkpoint_manifest(checkpoint) -> dict[str, Any]:
    """The manifest of an indexed checkpoint."""
    rows = ((t.name, t.dtype, t.shape, t.nbytes) for t in checkpoint.tensors.values())
    return build_manifest(rows, checkpoint.metadata)


def plan_manifest(plan) -> dict[str, Any]:
    """The manifest of what a compiled plan would write."""
    return build_manifest(((t.name, t.dtype, t.shape, t.nbytes) for t in plan.tensors), plan.metadata)


def load_manifest(text: str | bytes) -> dict[str, Any] | None:
    """Parse ``text`` as a manifest; None if it is JSON of another kind. Raises
    ValueError for bad JSON or a tensor entry without a string dtype and integer shape."""
    obj = orjson.loads(text)
    if not (isinstance(obj, dict) and isinstance(obj.get("tensors"), dict)):
        return None
    for name, entry in obj["tensors"].items():
        ok = isinstance(entry, dict) and isinstance(entry.get("dtype"), str) and isinstance(entry.get("shape"), list)
        if not ok or not all(type(d) is int for d in entry["shape"]):
            raise ValueError(f"tensor {name!r} has no string dtype and integer shape")
    return obj
