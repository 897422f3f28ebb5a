"""A consolidated DCP checkpoint checked against what its writer left beside the shards.

Sharded safetensors record neither the world size nor any full shape: a tensor's shape
is where its chunks end. With the last rank's file gone, every tensor that rank shared
(all of them under FSDP2's ``Shard(0)``) is still tiled exactly, only shorter. What
catches it is the side files: Automodel's ``fqn_to_file_index_mapping.json`` names every
tensor, and a Hugging Face ``config.json`` fixes the shapes of a few.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import orjson

from streamck.errors import CheckpointError, listing
from streamck.source.header import TensorRef

# Tensors whose every dimension a Hugging Face text model's config fixes, by the
# top-level config keys that fix them. Only these: elsewhere a name does not say whose
# sizes a tensor has (a vision tower's layers in a multimodal model, MoE experts).
CONFIG_SHAPES: dict[re.Pattern[str], tuple[str, ...]] = {
    re.compile(r"(?:.*\.)?embed_tokens\.weight"): ("vocab_size", "hidden_size"),
    re.compile(r"lm_head\.weight"): ("vocab_size", "hidden_size"),
    re.compile(r"(?:.*\.)?model\.norm\.weight"): ("hidden_size",),
}


def cross_check(side_root: Path, tensors: Mapping[str, TensorRef]) -> None:
    """Raise CheckpointError, naming the side file, where ``tensors`` disagree with the
    tensor names of ``fqn_to_file_index_mapping.json`` or with the shapes ``config.json``
    implies; a side file that is not there checks nothing."""
    _check_names(side_root / "fqn_to_file_index_mapping.json", tensors)
    _check_shapes(side_root / "config.json", tensors)


def _load(path: Path) -> object:
    try:
        return orjson.loads(path.read_bytes())
    except orjson.JSONDecodeError as e:
        raise CheckpointError(f"not valid JSON ({e})", path) from None


def _check_names(mapping: Path, tensors: Mapping[str, TensorRef]) -> None:
    if not mapping.is_file():
        return
    names = _load(mapping)
    if not isinstance(names, dict):
        raise CheckpointError("is not an object of tensor name to file index", mapping)
    missing = [repr(n) for n in names if n not in tensors]
    extra = [repr(n) for n in tensors if n not in names]
    if missing:
        raise CheckpointError(f"names {len(missing)} tensors the shards do not hold: {listing(missing, 5)}", mapping)
    if extra:
        raise CheckpointError(f"does not name {len(extra)} tensors the shards hold: {listing(extra, 5)}", mapping)


def _check_shapes(config_path: Path, tensors: Mapping[str, TensorRef]) -> None:
    if not config_path.is_file():
        return
    config = _load(config_path)
    if not isinstance(config, dict):
        raise CheckpointError("is not a JSON object", config_path)
    for name, ref in tensors.items():
        keys = next((k for pattern, k in CONFIG_SHAPES.items() if pattern.fullmatch(name)), None)
        if keys is None or not all(type(config.get(k)) is int for k in keys):
            continue
        want = tuple(config[k] for k in keys)
        if ref.shape != want:
            said = " and ".join(f"{k} {config[k]}" for k in dict.fromkeys(keys))
            raise CheckpointError(
                f"{said} make {name!r} {list(want)}, the shards make it {list(ref.shape)} (a rank's file missing?)",
                config_path,
            )
