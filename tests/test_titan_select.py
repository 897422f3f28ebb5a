"""Rows of other tensors (streamck.source.select) read back exactly as numpy indexes them,
over every way a source stores a tensor: plain, a strided view, blocks cut on any axis,
blocks over the flattened elements; through every reader path (stream, copy, runs)."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamck.source.header import TensorRef
from streamck.source.reader import Reader
from streamck.source.runs import Tile
from streamck.source.select import Rows, concat, select


def _plain(tmp: Path, a: np.ndarray, name: str = "t") -> TensorRef:
    path = tmp / f"{name}.bin"
    path.write_bytes(b"\0" * 24 + a.tobytes())
    return TensorRef(name, "F32", a.shape, path, 24, 24 + a.nbytes)


def _tiled(tmp: Path, a: np.ndarray, cuts: list[list[int]], tag: str = "") -> TensorRef:
    """``a`` stored as blocks: ``cuts[d]`` are the block edges on axis d; each block C-contiguous
    in one of two files, in shuffled order."""
    edges = [[0, *sorted(set(c) - {0, n}), n] for c, n in zip(cuts, a.shape, strict=True)]
    boxes = [()]
    for e in edges:
        boxes = [(*b, (lo, hi)) for b in boxes for lo, hi in itertools.pairwise(e)]
    files = {tmp / f"r0{tag}.bin": bytearray(b"\0" * 8), tmp / f"r1{tag}.bin": bytearray(b"\0" * 16)}
    tiles = []
    for i, box in enumerate(reversed(boxes)):
        path = list(files)[i % 2]
        block = np.ascontiguousarray(a[tuple(slice(lo, hi) for lo, hi in box)])
        tiles.append(Tile(path, len(files[path]), tuple(lo for lo, _ in box), block.shape))
        files[path] += block.tobytes()
    for path, data in files.items():
        path.write_bytes(bytes(data))
    return TensorRef("t", "F32", a.shape, tiles[0].path, 0, a.nbytes, tiles=tuple(tiles))


def _flat(tmp: Path, a: np.ndarray, cut: int) -> TensorRef:
    """``a``'s flattened elements in two 1-D blocks (ZeRO's fragments)."""
    flat = a.reshape(-1)
    (tmp / "f0.bin").write_bytes(flat[:cut].tobytes())
    (tmp / "f1.bin").write_bytes(b"\0" * 4 + flat[cut:].tobytes())
    tiles = (Tile(tmp / "f0.bin", 0, (0,), (cut,)), Tile(tmp / "f1.bin", 4, (cut,), (flat.size - cut,)))
    return TensorRef("t", "F32", a.shape, tiles[0].path, 0, a.nbytes, tiles=tiles)


def _strided(tmp: Path, a: np.ndarray) -> TensorRef:
    """``a`` stored transposed, read as a torch view with strides."""
    t = np.ascontiguousarray(a.T)
    path = tmp / "s.bin"
    path.write_bytes(t.tobytes())
    return TensorRef("t", "F32", a.shape, path, 0, a.nbytes, strides=(1, a.shape[0]))


def _read_all_ways(tmp: Path, ref: TensorRef, chunk: int = 1 << 20) -> list[bytes]:
    with Reader(chunk=chunk) as reader:
        streamed = reader.read(ref)
        out = tmp / "copy.out"
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            reader.copy(ref, fd)
        finally:
            os.close(fd)
        windows = b"".join(bytes(w) for w in reader.windows(ref, 52))
    found = [streamed, out.read_bytes(), windows]
    if not any(p.strides for p in ref.parts or (ref,)):  # a view has no runs: it is gathered
        runs = b""
        for run in ref.runs():
            with open(run.path, "rb") as f:
                f.seek(run.offset)
                runs += f.read(run.length)
        found.append(runs)
    return found


def _rope(a: np.ndarray, heads: int) -> np.ndarray:
    """torchtitan's permutation: w.view(H, hd/2, 2, D).transpose(1, 2).reshape(-1, D)."""
    rows, d = a.shape
    return a.reshape(heads, rows // heads // 2, 2, d).transpose(0, 2, 1, 3).reshape(rows, d)


def _check(tmp: Path, ref: TensorRef, want: np.ndarray) -> None:
    assert ref.shape == want.shape
    assert ref.end - ref.start == want.nbytes
    for got in _read_all_ways(tmp, ref):
        np.testing.assert_array_equal(np.frombuffer(got, np.float32).reshape(want.shape), want)


A = np.arange(12 * 8 * 5, dtype=np.float32).reshape(12, 8, 5)  # [layers, rows, cols]
M = np.arange(24 * 7, dtype=np.float32).reshape(24, 7)


def _sources(tmp: Path, a: np.ndarray) -> dict[str, TensorRef]:
    cuts = [[] for _ in a.shape]
    rows0 = [[a.shape[0] // 2 + 1], *cuts[1:]]  # Shard(0), uneven, mid-head
    last = [*cuts[:-1], [a.shape[-1] // 2]]  # cut on the last axis (Megatron's row-parallel)
    both = [[a.shape[0] // 3], *[[d // 2] for d in a.shape[1:]]]
    return {
        "plain": _plain(tmp, a),
        "rows": _tiled(tmp, a, rows0, "rows"),
        "last": _tiled(tmp, a, last, "last"),
        "both": _tiled(tmp, a, both, "both"),
        "flat": _flat(tmp, a, a.size // 2 + 3),
    }


@pytest.mark.parametrize("kind", ["plain", "rows", "last", "both", "flat"])
def test_spans_index_and_rope_match_numpy(tmp_path, kind):
    ref = _sources(tmp_path, M)[kind]
    _check(tmp_path, select(ref, Rows.span(5, 17)), M[5:17])
    _check(tmp_path, select(ref, Rows.rope_halves(4, 6)), _rope(M, 4))
    _check(tmp_path, select(ref, Rows.rope_halves(2, 6, first=6)), _rope(M[6:18], 2))
    (tmp_path / "s").mkdir()
    stacked = _sources(tmp_path / "s", A)
    for i in (0, 7, 11):
        _check(tmp_path, select(stacked[kind], index=i), A[i])
        _check(tmp_path, select(stacked[kind], Rows.span(2, 7), index=i), A[i, 2:7])
        _check(tmp_path, select(stacked[kind], Rows.rope_halves(2, 4), index=i), _rope(A[i], 2))


def test_a_gathered_view_has_no_runs(tmp_path):
    with pytest.raises(ValueError, match="read through a Reader"):
        list(select(_plain(tmp_path, M), Rows.rope_halves(4, 6)).runs())


def test_strided_source(tmp_path):
    ref = _strided(tmp_path, M)
    _check(tmp_path, select(ref, Rows.span(3, 9)), M[3:9])
    _check(tmp_path, select(ref, Rows.rope_halves(4, 6)), _rope(M, 4))


@pytest.mark.parametrize("kind", ["plain", "rows", "last", "flat"])
def test_megatron_qkv_groups_and_gate_up(tmp_path, kind):
    """A fused [q_g0, k_g0, v_g0, q_g1, ...] per layer split into q, k, v by groups; gate/up halves."""
    ref = _sources(tmp_path, A)[kind]
    groups, per, hd = 2, 2, 1  # 8 rows: 2 query groups of (2 q heads, k, v), 1 row each
    step = (per + 2) * hd
    for layer in (0, 5):
        q = concat("q", [select(ref, Rows.span(g * step, g * step + per * hd), index=layer) for g in range(groups)])
        k = concat(
            "k",
            [
                select(ref, Rows.span(g * step + per * hd, g * step + (per + 1) * hd), index=layer)
                for g in range(groups)
            ],
        )
        want = A[layer].reshape(groups, per + 2, hd, 5)  # [g, q heads | k | v, hd, cols]
        _check(tmp_path, q, want[:, :per].reshape(-1, 5))
        _check(tmp_path, k, want[:, per].reshape(-1, 5))
        _check(tmp_path, select(ref, Rows.span(4, 8), index=layer), A[layer, 4:])


def test_refused_selections(tmp_path):
    ref = _plain(tmp_path, M)
    with pytest.raises(ValueError, match="index 24"):
        select(ref, index=24)
    with pytest.raises(ValueError, match=r"rows \[20, 26\)"):
        select(ref, Rows.span(20, 26))
    with pytest.raises(ValueError, match="does not stack"):
        concat("x", [ref, _plain(tmp_path, A, "a")])


def test_permutation_is_compact(tmp_path):
    """A large RoPE permutation is one view over a plain tensor, one per block over blocks:
    never one object per row."""
    big = TensorRef("q", "BF16", (8192, 8192), Path("/nonexistent"), 0, 8192 * 8192 * 2)
    sel = select(big, Rows.rope_halves(64, 128))
    assert len(sel.parts) == 1 and sel.parts[0].shape == (64, 2, 64, 8192)
    half = 4096 * 8192 * 2
    tiles = (Tile(Path("/a"), 0, (0, 0), (4096, 8192)), Tile(Path("/b"), 0, (4096, 0), (4096, 8192)))
    sharded = big._replace(tiles=tiles, start=0, end=2 * half)
    assert len(select(sharded, Rows.rope_halves(64, 128)).parts) == 64  # a view per head


@settings(max_examples=40, deadline=None)
@given(
    cut0=st.integers(1, 23),
    cut1=st.integers(0, 6),
    heads=st.sampled_from([1, 2, 3, 6]),
    first=st.integers(0, 4),
)
def test_random_cuts_rope(tmp_path_factory, cut0, cut1, heads, first):
    tmp = tmp_path_factory.mktemp("h")
    hd = 4
    ref = _tiled(tmp, M, [[cut0], [cut1]])
    if first + heads * hd > M.shape[0]:
        return
    _check(tmp, select(ref, Rows.rope_halves(heads, hd, first=first)), _rope(M[first : first + heads * hd], heads))


def test_shape_errors_name_derived_sizes():
    """A fused QKV of the wrong height is refused naming how its height is made."""
    from streamck.errors import PlanError
    from streamck.plan.hf_export import check

    ref = TensorRef("decoder.layers.self_attention.linear_qkv.weight", "F32", (2, 100, 64), Path("x"), 0, 51200)
    sizes = {"L": 2, "QKV": 128, "H": 64}
    with pytest.raises(
        PlanError,
        match=r"expected \[2, 128, 64\] = \[L, QKV, H\] from L = num_hidden_layers, "
        r"QKV = \(num_attention_heads \+ 2 \* num_key_value_heads\) \* head_dim",
    ):
        check(ref.name, ref, ("L", "QKV", "H"), sizes, Path("ckpt"))


def test_gathered_rows_are_never_shared_as_blocks(tmp_path):
    """A reflink clone shares a source's bytes as they lie: rows gathered from elsewhere in a
    file (a RoPE view, a group of ranges) are not those bytes."""
    from streamck.plan.compile import OutputTensor
    from streamck.writer.clone import Sharing

    ref = _plain(tmp_path, M)
    sharing = Sharing(os.stat(tmp_path).st_dev)
    assert sharing.may_share(OutputTensor("w", ref, "F32"))
    for sel in (select(ref, Rows.rope_halves(4, 6)), concat("q", [select(ref, Rows.span(0, 2)),
                                                                  select(ref, Rows.span(4, 6))])):  # fmt: skip
        assert not sharing.may_share(OutputTensor("q", sel, "F32"))
