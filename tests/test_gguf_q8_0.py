"""The Q8_0 transform (streamck/transforms/q8_0.py): gguf-py's blocks, one band of rows at a time."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import raw_file

from streamck.source import open_checkpoint
from streamck.source.reader import Reader
from streamck.transforms import q8_0


class _Target:
    def __init__(self, source):
        self.name, self.source, self.dtype = source.name, source, "U8"


def _awkward(rows: int, cols: int) -> np.ndarray:
    """Values that test the rounding: a zero block, exact halves, the block's max at ±127·d,
    tiny and huge magnitudes, besides normal noise."""
    rng = np.random.default_rng(0)
    x = rng.normal(0, 1, (rows, cols)).astype(np.float32)
    x[0, :32] = 0
    x[1, :32] = np.arange(32) - 15.5  # halves after scaling by 127 / 15.5 are not all ties; these are
    x[2, :32] = np.linspace(-1, 1, 32) * 1e-30
    x[3, :32] = np.linspace(-1, 1, 32) * 6e4
    return x


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
def test_bands_equal_gguf_whole(tmp_path, monkeypatch, dtype):
    """Quantized in bands of 3 rows (Q8_VALUES shrunk), the bytes are gguf-py's quantize of the
    whole tensor widened to float32, as the reference does."""
    import gguf
    from gguf.quants import quantize

    x = _awkward(10, 96)
    raw = {"F32": x, "F16": x.astype(np.float16), "BF16": (x.view(np.uint32) >> 16).astype(np.uint16)}[dtype]
    header = {"w": {"dtype": dtype, "shape": list(x.shape), "data_offsets": [0, raw.nbytes]}}
    path = raw_file(tmp_path / "w.safetensors", header, raw.tobytes())
    ref = open_checkpoint(path).tensors["w"]
    monkeypatch.setattr(q8_0, "Q8_VALUES", 3 * 96)
    with Reader() as reader:
        pieces = list(q8_0.Q8_0(ref.shape).pieces(_Target(ref), reader, {}))
    got = b"".join(bytes(p) for p in pieces)
    widened = q8_0.widen(raw.tobytes(), dtype).reshape(x.shape)
    assert len(pieces) == 4
    assert got == quantize(widened, gguf.GGMLQuantizationType.Q8_0).tobytes()
    assert len(got) == 10 * 3 * 34 == np.prod(q8_0.q8_0_shape((10, 96)))


def test_widen_is_exact_for_bfloat16():
    bits = np.array([0x3F80, 0xBF81, 0x7F7F, 0x0001], dtype=np.uint16)
    assert q8_0.widen(bits.tobytes(), "BF16").view(np.uint32).tolist() == [b << 16 for b in bits.tolist()]


def test_the_references_type_rules():
    """F32 for 1-D tensors, norms and biases; Q8_0 for matrices whose rows are whole blocks, F16
    for the others (the reference's QuantError fallback); the file type's float elsewhere."""
    import gguf

    from streamck.writer.formats.gguf.plan import _qtype

    q8, bf16 = gguf.LlamaFileType.MOSTLY_Q8_0, gguf.LlamaFileType.MOSTLY_BF16
    assert _qtype("blk.0.attn_q.weight", (64, 64), q8) == "Q8_0"
    assert _qtype("blk.0.ffn_down.weight", (64, 48), q8) == "F16"
    assert _qtype("blk.0.attn_norm.weight", (64,), q8) == "F32"
    assert _qtype("blk.0.attn_q.bias", (64,), bf16) == "F32"
    assert _qtype("blk.0.attn_q.weight", (64, 64), bf16) == "BF16"
