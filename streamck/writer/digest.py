"""Digests of what a plan would write, without writing it: each output tensor's bytes as a
rewrite produces them (copied, cast on the CPU, or computed by its transform), hashed."""

from __future__ import annotations

import hashlib
from typing import Any

from streamck.gcpause import paused
from streamck.manifest import build_manifest
from streamck.plan import Plan
from streamck.writer.shardwriter import ShardWriter

ALGORITHM = "sha256"  # as streamck.check.digest's, so that diff compares the two


def plan_digests(plan: Plan) -> dict[str, Any]:
    """``plan``'s manifest with the sha256 of every output tensor's bytes, in bounded memory."""
    writer = ShardWriter(chunk=8 << 20, device=None, drop_cache=False, progress=lambda n: None)
    digests = {}
    with paused():  # a digest and a few dicts per tensor (see streamck.gcpause)
        try:
            for t in plan.tensors:
                h = hashlib.new(ALGORITHM)
                for piece in writer.pieces(t):
                    h.update(piece)
                digests[t.name] = {ALGORITHM: h.hexdigest()}
        finally:
            writer.close()
        rows = ((t.name, t.dtype, t.shape, t.nbytes) for t in plan.tensors)
        return build_manifest(rows, plan.metadata, digests)
