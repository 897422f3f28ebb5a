"""Runs: where a tensor's bytes are, in its row-major order.

Every source describes a tensor the same way: an ordered sequence of byte runs
``(path, offset, length)`` whose concatenation is the tensor. A plain tensor is
one run; a tensor saved in blocks (a DCP chunk per rank, a ZeRO fragment per
rank) is the blocks' rows interleaved in row-major order. Runs are produced
lazily: a tensor sharded on its last dimension has one run per row per block.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple


class Run(NamedTuple):
    """``length`` bytes of ``path`` from absolute ``offset``."""

    path: Path
    offset: int
    length: int


class Tile(NamedTuple):
    """One C-contiguous block of a larger tensor, stored at ``path[start:]``.

    ``offsets`` place it in the full tensor (elements, per dimension); ``sizes`` is its shape.
    """

    path: Path
    start: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


def tiling_error(shape: tuple[int, ...], tiles: Sequence[Tile]) -> str | None:
    """What is wrong with ``tiles`` as an exact cover of ``shape`` (gap, overlap, out of
    bounds, rank), or None when every element is in exactly one tile."""
    for t in tiles:
        if len(t.offsets) != len(shape) or len(t.sizes) != len(shape):
            return f"a block at {list(t.offsets)} has rank {len(t.sizes)}, the tensor {len(shape)}"
        if any(o < 0 or o + s > d for o, s, d in zip(t.offsets, t.sizes, shape, strict=True)):
            return f"block at {list(t.offsets)} of shape {list(t.sizes)} lies outside {list(shape)}"
    if sum(math.prod(t.sizes) for t in tiles) != math.prod(shape):
        covered = sum(math.prod(t.sizes) for t in tiles)
        return f"blocks hold {covered} elements, the tensor {math.prod(shape)}: " + (
            "a gap (a block or rank file missing?)" if covered < math.prod(shape) else "blocks overlap"
        )
    boxes = sorted((t.offsets, t.sizes) for t in tiles if math.prod(t.sizes) and t.sizes)
    for i, (oa, sa) in enumerate(boxes):  # equal counts and no overlap: an exact cover
        for ob, sb in boxes[i + 1 :]:
            if ob[0] >= oa[0] + sa[0]:
                break
            if all(a < b + m and b < a + n for a, n, b, m in zip(oa, sa, ob, sb, strict=True)):
                return f"blocks at {list(oa)} and {list(ob)} overlap"
    return None


def tile_runs(shape: tuple[int, ...], itemsize: int, tiles: Sequence[Tile]) -> Iterator[Run]:
    """The runs of a tensor of ``shape`` covered exactly by ``tiles`` (see tiling_error), in
    row-major order, runs that continue one another in one file merged.

    Dimensions after ``k`` that every tile spans whole make each tile contiguous over them,
    so the tensor is walked as rows over the dimensions before ``k``; within a row, tiles
    follow one another along ``k``, each one run.
    """
    tiles = [t for t in tiles if math.prod(t.sizes)]
    if not tiles:
        return
    if not shape:  # a scalar: its one block
        yield Run(tiles[0].path, tiles[0].start, itemsize)
        return
    k = len(shape) - 1
    while k > 0 and all(t.offsets[k] == 0 and t.sizes[k] == shape[k] for t in tiles):
        k -= 1
    inner = math.prod(shape[k + 1 :]) * itemsize
    if k == 0:
        rows: list[tuple[int, ...]] = [()]
    else:
        rows = _rows(shape[:k])
    pending: Run | None = None
    for row in rows:
        hits = sorted(
            (t for t in tiles if all(o <= r < o + s for r, o, s in zip(row, t.offsets, t.sizes, strict=False))),
            key=lambda t: t.offsets[k],
        )
        for t in hits:
            local = 0  # the row's element offset within the tile, over dims < k
            for r, o, s in zip(row, t.offsets, t.sizes[1 : k + 1], strict=False):
                local = (local + (r - o)) * s
            run = Run(t.path, t.start + local * inner, t.sizes[k] * inner)
            if pending is not None and pending.path == run.path and pending.offset + pending.length == run.offset:
                pending = Run(run.path, pending.offset, pending.length + run.length)
                continue
            if pending is not None:
                yield pending
            pending = run
    if pending is not None:
        yield pending


def _rows(shape: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    import itertools

    return itertools.product(*map(range, shape))


class RowBlocks:
    """A tensor tiled along its first dimension and at most one more, seen as ``rows`` rows
    of ``row_bytes`` bytes: with ``k`` the other cut dimension, a row is one index over the
    dimensions before ``k`` (which tiles must span whole but for the first), and each tile
    is a block of whole rows ``[r0, r1)`` and byte columns ``[c0, c0 + width)``, stored row
    after row. Reading a window is then one read per tile (its rows are consecutive in its
    file) and one strided placement, however many short runs the window holds. ``of``
    gives None for other tilings, which are read run by run."""

    def __init__(self, rows: int, row_bytes: int, blocks: list[tuple[Path, int, int, int, int, int]]):
        self.rows, self.row_bytes = rows, row_bytes
        self.blocks = blocks  # (path, start, r0, r1, c0, width)

    @classmethod
    def of(cls, shape: tuple[int, ...], itemsize: int, tiles: Sequence[Tile]) -> RowBlocks | None:
        tiles = [t for t in tiles if math.prod(t.sizes)]
        if not shape or not tiles:
            return None
        cut = [d for d in range(len(shape)) if any(t.offsets[d] or t.sizes[d] != shape[d] for t in tiles)]
        k = max(cut, default=0)
        if any(d not in (0, k) for d in cut):
            return None
        per = math.prod(shape[1:k]) if k else 1  # rows per index of the first dimension
        row_bytes = math.prod(shape[max(k, 1) :]) * itemsize
        inner = math.prod(shape[k + 1 :]) * itemsize
        blocks = []
        for t in tiles:
            c0, width = (t.offsets[k] * inner, t.sizes[k] * inner) if k else (0, row_bytes)
            blocks.append((t.path, t.start, t.offsets[0] * per, (t.offsets[0] + t.sizes[0]) * per, c0, width))
        return cls(shape[0] * per, row_bytes, blocks)

    @property
    def whole_rows(self) -> bool:
        """Every block spans whole rows: its bytes are one run (a Shard(0) split, ZeRO fragments)."""
        return all(width == self.row_bytes for *_, width in self.blocks)
