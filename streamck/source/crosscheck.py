"""A consolidated DCP checkpoint checked against what its writer left beside the shards.

Sharded safetensors record neither the world size nor any full shape: a tensor's shape
is where its chunks end. With the last rank's file gone, every tensor that rank shared
(all of them under FSDP2's ``Shard(0)``) is still tiled exactly, only shorter. What
catches it is the side files: Automodel's ``fqn_to_file_index_mapping.json`` names every
tensor, and a Hugging Face ``config.json`` fixes the length of a few.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import orjson

from streamck.errors import CheckpointError, listing
from streamck.source.header import TensorRef

# Tensors whose first dimension a Hugging Face config fixes, by the top-level keys that may
# (the first one present counts). Only the first: that is the dimension FSDP2's Shard(0),
# and tensor parallelism's split of embeddings and heads, cut, so a missing rank file
# shortens it; the others vary by architecture (OPT projects its embedding to
# word_embed_proj_dim, not hidden_size). An EAGLE-3 draft's head covers its own vocabulary.
CONFIG_ROWS: dict[re.Pattern[str], tuple[str, ...]] = {
    re.compile(r"(?:.*\.)?embed_tokens\.weight"): ("vocab_size",),
    re.compile(r"lm_head\.weight"): ("draft_vocab_size", "vocab_size"),
    re.compile(r"(?:.*\.)?model\.norm\.weight"): ("hidden_size",),
}


def cross_check(side_root: Path, tensors: Mapping[str, TensorRef]) -> None:
    """Raise CheckpointError, naming the side file, where ``tensors`` disagree with the
    tensor names of ``fqn_to_file_index_mapping.json`` or with the lengths ``config.json``
    implies (CONFIG_ROWS); a side file that is not there checks nothing."""
    _check_names(side_root / "fqn_to_file_index_mapping.json", tensors)
    _check_rows(side_root / "config.json", tensors)


def side_object(path: Path, not_object: str) -> dict | None:
    """The JSON object in side file ``path``; None when there is no such file."""
    if not path.is_file():
        return None
    try:
        obj = orjson.loads(path.read_bytes())
    except orjson.JSONDecodeError as e:
        raise CheckpointError(f"not valid JSON ({e})", path) from None
    if not isinstance(obj, dict):
        raise CheckpointError(not_object, path)
    return obj


def _check_names(mapping: Path, tensors: Mapping[str, TensorRef]) -> None:
    names = side_object(mapping, "is not an object of tensor name to file index")
    if names is None:
        return
    missing = [repr(n) for n in names if n not in tensors]
    extra = [repr(n) for n in tensors if n not in names]
    if missing:
        raise CheckpointError(f"names {len(missing)} tensors the shards do not hold: {listing(missing, 5)}", mapping)
    if extra:
        raise CheckpointError(f"does not name {len(extra)} tensors the shards hold: {listing(extra, 5)}", mapping)


def _check_rows(config_path: Path, tensors: Mapping[str, TensorRef]) -> None:
    config = side_object(config_path, "is not a JSON object")
    if config is None:
        return
    for name, ref in tensors.items():
        keys = next((k for pattern, k in CONFIG_ROWS.items() if pattern.fullmatch(name)), ())
        key = next((k for k in keys if type(config.get(k)) is int), None)
        if key is not None and ref.shape[:1] != (config[key],):
            raise CheckpointError(
                f"{key} {config[key]} gives {name!r} {config[key]} rows, the shards "
                f"{ref.shape[0] if ref.shape else 'none'} (a rank's file missing?)",
                config_path,
            )
