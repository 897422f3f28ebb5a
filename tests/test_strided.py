"""Gathering strided views: any shape, strides and block size give numpy's as_strided bytes."""

import mmap

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from streamck.source.header import TensorRef
from streamck.source.strided import gather, strided_array


@st.composite
def views(draw):
    rank = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=rank, max_size=rank)))
    # Strides of a permuted, sliced, expanded (0) or gapped layout.
    strides = tuple(draw(st.lists(st.integers(0, 60), min_size=rank, max_size=rank)))
    item = draw(st.sampled_from([1, 2, 4, 8]))
    lead = draw(st.integers(0, 50))
    chunk = draw(st.integers(1, 400))
    return shape, strides, item, lead, chunk


@settings(max_examples=300, deadline=None)
@given(views())
def test_gather_equals_as_strided(tmp_path_factory, view):
    shape, strides, item, lead, chunk = view
    span = 1 + sum((e - 1) * s for e, s in zip(shape, strides, strict=True))
    path = tmp_path_factory.mktemp("g") / "storage"
    path.write_bytes(np.random.default_rng(span).integers(0, 256, (lead + span) * item, dtype=np.uint8).tobytes())
    numel = int(np.prod(shape))
    ref = TensorRef("t", "U8", shape, path, lead * item, lead * item + numel * item, strides)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        want = np.ascontiguousarray(strided_array(ref, mm)).tobytes()
    blocks = [bytes(b) for b in gather(ref, chunk)]
    assert b"".join(blocks) == want
    assert all(len(b) <= max(chunk, item) for b in blocks)


def test_transposed_matrix_is_read_in_runs(tmp_path):
    # A 300 x 200 F32 matrix saved transposed; 4 KiB blocks force the run-by-run path.
    base = np.random.default_rng(0).standard_normal((300, 200)).astype(np.float32)
    (tmp_path / "m").write_bytes(base.tobytes())
    ref = TensorRef("t", "F32", (200, 300), tmp_path / "m", 0, base.nbytes, (1, 200))
    assert b"".join(bytes(b) for b in gather(ref, 4096)) == base.T.tobytes()
