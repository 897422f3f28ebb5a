"""Checks for CI and for trust: key-set diffs, tensor digests, data comparison. Headers only
unless bytes are asked for; never torch."""

from streamck.check.diff import DiffResult, collapse, diff, load_side
from streamck.check.digest import hash_manifest, tensor_digests

__all__ = ["DiffResult", "collapse", "diff", "hash_manifest", "load_side", "tensor_digests"]
