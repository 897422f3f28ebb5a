"""Views and tiles read through the one Reader: any shape, strides, blocks and window size
give the bytes numpy assembles on its own."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from streamck.source.header import TensorRef
from streamck.source.reader import Reader
from streamck.source.runs import Tile, tile_runs, tiling_error


@st.composite
def views(draw):
    rank = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=rank, max_size=rank)))
    # Strides of a permuted, sliced, expanded (0) or gapped layout.
    strides = tuple(draw(st.lists(st.integers(0, 60), min_size=rank, max_size=rank)))
    item = draw(st.sampled_from([1, 2, 4, 8]))
    lead = draw(st.integers(0, 50))
    chunk = draw(st.integers(1, 400))
    window = draw(st.integers(1, 500))
    return shape, strides, item, lead, chunk, window


def _oracle(data: bytes, shape, strides, item, lead) -> bytes:
    base = np.frombuffer(data, np.dtype(f"<u{item}"), offset=lead * item)
    view = np.lib.stride_tricks.as_strided(base, shape, [s * item for s in strides])
    return np.ascontiguousarray(view).tobytes()


def _read(ref: TensorRef, chunk: int, window: int) -> list[bytes]:
    with Reader(chunk) as reader:
        return [bytes(w) for w in reader.windows(ref, window)]


@settings(max_examples=300, deadline=None)
@given(views())
def test_view_equals_as_strided(tmp_path_factory, view):
    shape, strides, item, lead, chunk, window = view
    span = 1 + sum((e - 1) * s for e, s in zip(shape, strides, strict=True))
    path = tmp_path_factory.mktemp("g") / "storage"
    data = np.random.default_rng(span).integers(0, 256, (lead + span) * item, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    numel = int(np.prod(shape))
    ref = TensorRef(
        "t",
        {1: "U8", 2: "U16", 4: "U32", 8: "U64"}[item],
        shape,
        path,
        lead * item,
        lead * item + numel * item,
        strides,
    )
    want = _oracle(data, shape, strides, item, lead)
    windows = _read(ref, max(chunk, item), window)
    assert b"".join(windows) == want
    assert all(len(w) == min(window, max(chunk, item)) for w in windows[:-1])  # fixed windows


def test_transposed_matrix_is_read_in_runs(tmp_path):
    # A 300 x 200 F32 matrix saved transposed; 4 KiB blocks force the run-by-run path.
    base = np.random.default_rng(0).standard_normal((300, 200)).astype(np.float32)
    (tmp_path / "m").write_bytes(base.tobytes())
    ref = TensorRef("t", "F32", (200, 300), tmp_path / "m", 0, base.nbytes, (1, 200))
    assert b"".join(_read(ref, 4096, 4096)) == base.T.tobytes()


@st.composite
def tilings(draw):
    """A tensor cut into blocks along up to two dimensions, blocks spread over files."""
    rank = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=rank, max_size=rank)))
    cuts = []
    for d in shape:
        points = sorted(set(draw(st.lists(st.integers(1, max(1, d - 1)), max_size=2)))) if d > 1 else []
        cuts.append([0, *[p for p in points if 0 < p < d], d])
    files = draw(st.integers(1, 3))
    window = draw(st.integers(1, 300))
    scratch = draw(st.sampled_from([1, 5, 64, 4 << 20]))  # rows read per batch: one, a few, all
    return shape, cuts, files, window, scratch, draw(st.randoms())


@settings(max_examples=300, deadline=None)
@given(tilings())
def test_tiles_read_in_row_major_order(tmp_path_factory, case):
    import streamck.source.reader as reader_module

    shape, cuts, nfiles, window, scratch, rnd = case
    full = np.random.default_rng(len(shape)).integers(0, 1 << 16, shape, dtype=np.uint16)
    root = tmp_path_factory.mktemp("t")
    blobs = [bytearray(rnd.randrange(0, 5)) for _ in range(nfiles)]  # a few lead bytes each
    tiles = []
    boxes = list(np.ndindex(*[len(c) - 1 for c in cuts]))
    rnd.shuffle(boxes)  # blocks land in files in any order
    for box in boxes:
        lo = [cuts[d][i] for d, i in enumerate(box)]
        hi = [cuts[d][i + 1] for d, i in enumerate(box)]
        block = full[tuple(slice(a, b) for a, b in zip(lo, hi, strict=True))]
        f = rnd.randrange(nfiles)
        tiles.append((f, len(blobs[f]), tuple(lo), block.shape))
        blobs[f] += block.tobytes()
    paths = [root / f"f{i}" for i in range(nfiles)]
    for p, b in zip(paths, blobs, strict=True):
        p.write_bytes(bytes(b))
    tiles = tuple(Tile(paths[f], start, lo, size) for f, start, lo, size in tiles)
    assert tiling_error(shape, tiles) is None
    ref = TensorRef("t", "U16", shape, paths[0], 0, full.nbytes, None, tiles)
    saved, reader_module.SCRATCH = reader_module.SCRATCH, scratch
    try:
        assert b"".join(_read(ref, 64, window)) == full.tobytes()
    finally:
        reader_module.SCRATCH = saved
    runs = list(tile_runs(shape, 2, tiles))
    assert b"".join(bytes(blobs[paths.index(r.path)][r.offset : r.offset + r.length]) for r in runs) == full.tobytes()
    with Reader(64) as reader:
        out = root / "copy"
        with open(out, "wb") as f:
            reader.copy(ref, f.fileno())
    assert out.read_bytes() == full.tobytes()


def test_tiling_errors_name_the_fault(tmp_path):
    p = tmp_path / "f"
    t = lambda lo, size: Tile(p, 0, lo, size)  # noqa: E731
    assert tiling_error((4, 4), [t((0, 0), (2, 4)), t((2, 0), (2, 4))]) is None
    assert "gap" in tiling_error((4, 4), [t((0, 0), (2, 4))])
    assert "overlap" in tiling_error((4, 4), [t((0, 0), (3, 4)), t((2, 0), (2, 4))])
    assert "overlap" in tiling_error((4, 4), [t((0, 0), (2, 4)), t((0, 0), (2, 4))])
    assert "outside" in tiling_error((4, 4), [t((0, 0), (2, 4)), t((3, 0), (2, 4))])
    assert "rank" in tiling_error((4, 4), [t((0,), (16,))])


def test_the_fd_pool_is_bounded(tmp_path, monkeypatch):
    import streamck.source.reader as reader_module

    monkeypatch.setattr(reader_module, "MAX_FDS", 2)
    full = np.arange(5 * 6, dtype=np.uint16).reshape(5, 6)
    tiles = []
    for i in range(3):  # three files, columns split: every window reads all three
        (tmp_path / f"f{i}").write_bytes(full[:, 2 * i : 2 * i + 2].tobytes())
        tiles.append(Tile(tmp_path / f"f{i}", 0, (0, 2 * i), (5, 2)))
    ref = TensorRef("t", "U16", (5, 6), tmp_path / "f0", 0, full.nbytes, None, tuple(tiles))
    with Reader(16) as reader:
        assert b"".join(bytes(w) for w in reader.windows(ref, 7)) == full.tobytes()
        assert len(reader._fds) <= 2
