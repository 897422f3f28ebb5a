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


def _edges(rows: int, cols: int) -> np.ndarray:
    """_awkward's values and the blocks where a faster quantizer could part from gguf-py's: exact
    ties (a block's max 127, so d = 1 and x / d is x), -0.0, a scale that overflows float16, a
    subnormal scale, a block of subnormals, NaN and ±inf (gguf-py casts NaN to int8 there)."""
    x = _awkward(rows, cols)
    x[4, :32] = np.concatenate([[127.0], np.arange(31) - 15.5])  # every other value a tie
    x[5, :32] = -x[4, :32]
    x[6, :32] = -0.0
    x[7, :32] *= 1e7  # d = max / 127 > 65504: inf as float16
    x[8, :32] = np.linspace(-1, 1, 32) * 1e-37  # d subnormal: x / d past 127 once rounded
    x[9, :32] = np.float32(1e-45) * np.arange(32)
    x[10, 3], x[11, 40], x[12, 70] = np.nan, np.inf, -np.inf
    x[13, :32] = np.nextafter(np.float32(0.5), np.float32(0)) * np.sign(np.arange(32) - 15.5)
    x[13, 0] = 127.0  # d = 1: x / d is 0.49999997, which rounds to 0 (to 1 once 0.5 is added to it)
    return x


def _reference(x: np.ndarray) -> bytes:
    import warnings

    import gguf
    from gguf.quants import quantize

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        return quantize(x, gguf.GGMLQuantizationType.Q8_0).tobytes()


@pytest.mark.parametrize("chunk", [3, 2048])
@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16", "F64"])
def test_quantize_equals_gguf_py(monkeypatch, dtype, chunk):
    """quantize (two threads, chunks of ``chunk`` blocks: a short last one) gives gguf-py's
    bytes for the source widened to float32, the edge blocks included."""
    from concurrent.futures import ThreadPoolExecutor

    x = _edges(300, 96)
    with np.errstate(over="ignore"):  # row 7 as float16: inf, as the reference's source would hold
        raw = {"F32": x, "F16": x.astype(np.float16), "F64": x.astype(np.float64) * (1 + 1e-9),
               "BF16": (x.view(np.uint32) >> 16).astype(np.uint16)}[dtype]  # fmt: skip
    monkeypatch.setattr(q8_0, "CHUNK_BLOCKS", chunk)
    with ThreadPoolExecutor(2) as pool, np.errstate(over="ignore"):
        got = q8_0.quantize(raw.reshape(-1), dtype, pool)
    assert got.shape == (300 * 3, 34)
    with np.errstate(over="ignore"):
        widened = q8_0.widen(raw.reshape(-1), dtype).reshape(x.shape)
    assert got.tobytes() == _reference(widened)


def test_the_fast_path_is_what_runs(monkeypatch):
    """Only the blocks with NaN, inf or a subnormal scale go to gguf-py's own quantize_blocks."""
    from gguf.quants import Q8_0

    sent = []
    real = Q8_0.quantize_blocks.__func__
    monkeypatch.setattr(Q8_0, "quantize_blocks", classmethod(lambda cls, b: sent.append(len(b)) or real(cls, b)))
    q8_0.quantize(_edges(20, 96).reshape(-1), "F32")
    assert sent == [4]  # rows 8 (subnormal scale), 10, 11 and 12 (NaN, inf, -inf)


def test_rounding_is_gguf_py_s_at_every_half():
    """floor(a + HALF) is gguf-py's np_roundf for a >= 0 around every k + 0.5 up to 127.5
    (4096 floats each side), at the largest float below 0.5, and on random values: the check
    has teeth, as floor(a + 0.5) fails it. (Every float32 in [0, 128] was checked once, offline.)"""
    from gguf.quants import np_roundf

    near = (np.arange(128, dtype=np.float32) + 0.5).view(np.int32)[:, None] + np.arange(-4096, 4097, dtype=np.int32)
    rng = np.random.default_rng(0)
    a = np.concatenate([near.ravel().view(np.float32), rng.uniform(0, 127.5, 1 << 20).astype(np.float32)])
    assert np.array_equal(np.floor(a + q8_0.HALF), np_roundf(a))
    assert not np.array_equal(np.floor(a + np.float32(0.5)), np_roundf(a))
