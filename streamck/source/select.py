"""Tensors made of other tensors' rows, described without reading a byte.

A converter that unstacks layers, splits a fused QKV or gate/up projection, undoes a
RoPE row interleaving or trims padded vocabulary rows only chooses rows of the first
axis of a source tensor (after, for a stacked tensor, one index of its leading axis).
``select`` turns such a choice into a TensorRef over the source's own bytes, and
``concat`` stacks several along the first axis; the reader reads them like any other:

* a row range of a plain tensor is a plain tensor (kernel-side copies stay possible),
  of a view a view, of a tensor in blocks (DCP chunks, ZeRO fragments) the blocks
  clipped to it, so a chunk cut on a later axis is still read a block at a time;
* a permutation is ``Rows``: a start and a grid of counts and steps (torchtitan's RoPE
  interleaving is three numbers per axis, whatever the model's size), read as a
  strided view gathered a block at a time (streamck.source.strided). On blocks, each
  group of rows that lies in one block's bytes is one such view; only a group cut by a
  block boundary falls back to one range per run of rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from streamck.dtypes import BITS
from streamck.source.header import TensorRef
from streamck.source.runs import Tile


class Rows(NamedTuple):
    """Rows of a first axis, in output order: ``start + sum(i[k] * steps[k])`` for ``i``
    over ``counts`` in row-major order."""

    start: int
    counts: tuple[int, ...]
    steps: tuple[int, ...]

    @classmethod
    def span(cls, first: int, stop: int) -> Rows:
        """Rows ``[first, stop)`` in order."""
        return cls(first, (stop - first,), (1,))

    @classmethod
    def rope_halves(cls, heads: int, head_dim: int, first: int = 0) -> Rows:
        """Interleaved RoPE pairs to rotate-half halves, per head: output row
        ``h*hd + a*hd/2 + j`` is source row ``h*hd + 2*j + a`` (torchtitan's and Meta's
        ``w.view(H, hd/2, 2, D).transpose(1, 2)``)."""
        return cls(first, (heads, 2, head_dim // 2), (head_dim, 1, 2))

    @property
    def count(self) -> int:
        return math.prod(self.counts)

    @property
    def bounds(self) -> tuple[int, int]:
        """The lowest row and one past the highest (steps are never negative)."""
        if not self.count:
            return self.start, self.start
        return self.start, self.start + 1 + sum((c - 1) * s for c, s in zip(self.counts, self.steps, strict=True))

    @property
    def is_span(self) -> bool:
        """Consecutive rows in order: one range (each axis steps over the ones after it)."""
        inner = [math.prod(self.counts[k + 1 :]) for k in range(len(self.counts))]
        return all(c == 1 or s == n for c, s, n in zip(self.counts, self.steps, inner, strict=True))

    def groups(self) -> list[Rows]:
        """The rows split by the first grid axis (one Rows per index of it)."""
        return [Rows(self.start + i * self.steps[0], self.counts[1:], self.steps[1:]) for i in range(self.counts[0])]


def _item(ref: TensorRef) -> int:
    return BITS[ref.dtype] // 8


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, step = [], 1
    for d in reversed(shape):
        out.append(step)
        step *= d
    return tuple(reversed(out))


def _with(ref: TensorRef, name: str, shape: tuple[int, ...], **fields) -> TensorRef:
    """``ref``'s dtype under ``name`` and ``shape``; ``end - start`` its byte size."""
    start = fields.pop("start", ref.start)
    size = math.prod(shape) * _item(ref)
    return TensorRef(name, ref.dtype, shape, fields.pop("path", ref.path), start, start + size, **fields)


def _flat(ref: TensorRef) -> bool:
    """Tiles over the flattened elements (ZeRO fragments), not over the shape."""
    return bool(ref.tiles) and len(ref.tiles[0].offsets) != len(ref.shape)


def _clip(ref: TensorRef, name: str, first: int, stop: int, drop: bool) -> TensorRef:
    """Rows ``[first, stop)`` of the first axis (with ``drop``, the one index ``first``,
    that axis removed), as the same kind of reference as ``ref``."""
    shape = ref.shape[1:] if drop else (stop - first, *ref.shape[1:])
    row = math.prod(ref.shape[1:])
    item = _item(ref)
    if ref.strides is not None:
        strides = ref.strides[1:] if drop else ref.strides
        return _with(ref, name, shape, start=ref.start + first * ref.strides[0] * item, strides=strides)
    if ref.tiles is None:
        return _with(ref, name, shape, start=ref.start + first * row * item)
    tiles = []
    if _flat(ref):  # element ranges: clip each 1-D block to the rows' elements
        a, b = first * row, stop * row
        for t in ref.tiles:
            lo, hi = max(a, t.offsets[0]), min(b, t.offsets[0] + t.sizes[0])
            if lo < hi:
                tiles.append(Tile(t.path, t.start + (lo - t.offsets[0]) * item, (lo - a,), (hi - lo,)))
    else:
        for t in ref.tiles:
            lo, hi = max(first, t.offsets[0]), min(stop, t.offsets[0] + t.sizes[0])
            if lo >= hi:
                continue
            start = t.start + (lo - t.offsets[0]) * math.prod(t.sizes[1:]) * item
            if drop:
                tiles.append(Tile(t.path, start, t.offsets[1:], t.sizes[1:]))
            else:
                tiles.append(Tile(t.path, start, (lo - first, *t.offsets[1:]), (hi - lo, *t.sizes[1:])))
    tiles.sort(key=lambda t: t.offsets)
    path = tiles[0].path if tiles else ref.path
    return _with(ref, name, shape, path=path, start=0, tiles=tuple(tiles))


def _block_of(ref: TensorRef, name: str, first: int, stop: int) -> TensorRef | None:
    """Rows ``[first, stop)`` as one plain reference when they lie contiguously in one
    file (a plain tensor, or inside one block), else None."""
    if ref.strides is not None:
        return None
    if ref.tiles is None:
        return _clip(ref, name, first, stop, False)
    row = math.prod(ref.shape[1:])
    for t in ref.tiles:
        if _flat(ref):
            a, n, inner = t.offsets[0], t.sizes[0], row
        elif t.offsets[1:] == (0,) * (len(t.offsets) - 1) and t.sizes[1:] == ref.shape[1:]:
            a, n, inner = t.offsets[0] * row, t.sizes[0] * row, row
        else:
            continue
        if a <= first * inner and stop * inner <= a + n:
            start = t.start + (first * inner - a) * _item(ref)
            return _with(ref, name, (stop - first, *ref.shape[1:]), path=t.path, start=start)
    return None


def _view(ref: TensorRef, name: str, rows: Rows) -> TensorRef:
    """``rows`` of a plain or strided ``ref`` as one strided view, wrapped to the output shape."""
    strides = ref.strides or _contiguous_strides(ref.shape)
    rest = ref.shape[1:]
    view = _with(
        ref,
        name,
        (*rows.counts, *rest),
        start=ref.start + rows.start * strides[0] * _item(ref),
        strides=(*(s * strides[0] for s in rows.steps), *strides[1:]),
    )
    return _with(view, name, (rows.count, *rest), strides=None, parts=(view,))


def select(ref: TensorRef, rows: Rows | None = None, *, index: int | None = None, name: str | None = None) -> TensorRef:
    """``ref[index][rows]`` under ``name`` (default ``ref``'s): ``index`` picks one entry of
    the leading axis of a stacked tensor, ``rows`` rows of the (next) first axis (all by
    default). Raises ValueError for an index or rows outside the tensor."""
    name = name or ref.name
    if ref.parts is not None and (index is not None or rows is None):
        raise ValueError(f"{ref.name}: rows of a gathered tensor are not selected again")
    if index is not None:
        if not ref.shape or not 0 <= index < ref.shape[0]:
            raise ValueError(f"{ref.name}: index {index} outside its leading axis of {ref.shape[:1]}")
        ref = _clip(ref, name, index, index + 1, True)
    if rows is None:
        return ref._replace(name=name)
    first, stop = rows.bounds
    if not ref.shape or first < 0 or stop > ref.shape[0]:
        raise ValueError(f"{ref.name}: rows [{first}, {stop}) outside its {ref.shape[:1]}")
    if ref.parts is not None:  # a permutation of a permutation (GGUF's q/k rows of torchtitan's)
        return _reselect(ref, rows, name)
    if rows.is_span:
        return _clip(ref, name, first, stop, False)
    block = _block_of(ref, name, first, stop)
    if block is not None:
        return _view(block, name, rows._replace(start=rows.start - first))
    if ref.strides is not None:
        return _view(ref, name, rows)
    return concat(name, [select(ref, g, name=name) for g in rows.groups()])


def _reselect(ref: TensorRef, rows: Rows, name: str) -> TensorRef:
    """``rows`` of a gathered tensor (each part its next rows): taken from the part that holds
    them where it does and they are again a grid over its bytes, else group by group (a single
    row always is), so a permutation of a permutation reads as few views as it can."""
    rest, spans, at = len(ref.shape) - 1, [], 0
    for part in ref.parts or ():
        n = math.prod(part.shape[: len(part.shape) - rest])
        spans.append((at, at + n, part))
        at += n

    def pick(r: Rows) -> list[TensorRef]:
        first, stop = r.bounds
        lo, _, part = next((s for s in spans if s[0] <= first and stop <= s[1]), (0, 0, None))
        got = None if part is None else _from_part(part, r._replace(start=r.start - lo), rest, name)
        return [got] if got is not None else [x for g in r.groups() for x in pick(g)]

    return concat(name, pick(rows))


def _from_part(part: TensorRef, rows: Rows, rest: int, name: str) -> TensorRef | None:
    """``rows`` of one part of a gathered tensor: a plain or blocked part's through select, a
    strided view's composed into one view of the same bytes (a plain range where that is one);
    None where they are no grid over the view's bytes."""
    lead = len(part.shape) - rest
    if part.strides is None:
        return select(part, rows, name=name)  # a plain or blocked part: its rows are its first axis's
    counts, steps = part.shape[:lead], part.strides[:lead]

    def offset(row: int) -> int:  # the row's place in the part's bytes, in elements
        at = 0
        for count, step in zip(reversed(counts), reversed(steps), strict=True):
            row, i = divmod(row, count)
            at += i * step
        return at

    base = offset(rows.start)
    grid = tuple(offset(rows.start + s) - base for s in rows.steps)
    if any(g < 0 for g in grid):
        return None
    for flat in range(rows.count):  # every row checked: a permutation of a view is not always a grid
        at, row, left = base, rows.start, flat
        for count, step, g in zip(reversed(rows.counts), reversed(rows.steps), reversed(grid), strict=True):
            left, i = divmod(left, count)
            row, at = row + i * step, at + i * g
        if offset(row) != at:
            return None
    shape, inner = (*rows.counts, *part.shape[lead:]), part.strides[lead:]
    start = part.start + base * _item(part)
    if (*grid, *inner) == _contiguous_strides(shape):  # the permutations undo each other
        return _with(part, name, (rows.count, *part.shape[lead:]), start=start)
    view = _with(part, name, shape, start=start, strides=(*grid, *inner))
    return _with(view, name, (rows.count, *part.shape[lead:]), strides=None, parts=(view,))


def concat(name: str, refs: Sequence[TensorRef]) -> TensorRef:
    """``refs`` one after another along the first axis, as one reference named ``name``.
    Raises ValueError when their dtypes or trailing shapes differ."""
    if not refs:
        raise ValueError(f"{name}: nothing to gather")
    first = refs[0]
    bad = [r.name for r in refs if r.dtype != first.dtype or r.shape[1:] != first.shape[1:] or not r.shape]
    if bad:
        raise ValueError(f"{name}: {bad[0]} does not stack with {first.name} ({first.dtype} {list(first.shape)})")
    if len(refs) == 1:
        return first._replace(name=name)
    parts = tuple(p for r in refs for p in (r.parts or (r,)))
    shape = (sum(r.shape[0] for r in refs), *first.shape[1:])
    return _with(first, name, shape, path=parts[0].path, start=0, strides=None, tiles=None, parts=parts)
