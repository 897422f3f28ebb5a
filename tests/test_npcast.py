"""The numpy caster against torch's CPU Tensor.to: every direction, its boundaries, NaN bits,
overflow counts; its read-ahead; and a cast in a process where torch cannot be imported."""

import itertools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import raw_file
from test_cast import TORCH, cast_via_streamck

from streamck import Rules, compile_plan, open_checkpoint, write_plan
from streamck.errors import CheckpointError
from streamck.transforms.cast import Caster
from streamck.transforms.npcast import Converter, can_overflow, equal_but_nan_bits

REPO = Path(__file__).resolve().parent.parent
SIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
UINT = {8: np.uint64, 4: np.uint32, 2: np.uint16}
DIRECTIONS = list(itertools.permutations(SIZE, 2))


def _f32_boundaries() -> np.ndarray:
    """Every F32 high half (all exponents, signs, NaN and inf) with every low half that
    matters to BF16 (ties at 0x8000) and F16 (ties at 0x1000 of the low 13 bits, and the
    subnormal range's wider ones), plus one on each side."""
    highs = np.arange(1 << 16, dtype=np.uint32)
    lows = [0, 1, 0x0FFF, 0x1000, 0x1001, 0x1FFF, 0x2000, 0x2001, 0x3000, 0x6000, 0x7FFF, 0x8000, 0x8001, 0xFFFF]
    return (highs[:, None] << 16 | np.array(lows, np.uint32)[None, :]).ravel()


def _f64_boundaries() -> np.ndarray:
    """F32 boundary values widened, and nudged by less than, exactly and more than half an
    F32 ulp: where rounding once (F64→F16/BF16 directly) and twice (through F32) differ."""
    f32 = _f32_boundaries()[::3].view(np.float32)
    f32 = f32[np.isfinite(f32)].astype(np.float64).view(np.uint64)
    nudges = np.array([0, 1, 2, (1 << 28) - 1, 1 << 28, (1 << 28) + 1, (1 << 29) - 1], np.uint64)
    special = [0x3690000000000000, 0x3690000000000001, 0x47EFFFFFE0000000, 0x47EFFFFFE0000001, 0x7FEFFFFFFFFFFFFF]
    special += [0x7FF0000000000000, 0x7FF0000000000001, 0xFFF8000000000000, 1, 0x8000000000000001, 0]
    up, down = (f32[:, None] + nudges).ravel(), (f32[:, None] - nudges).ravel()
    return np.concatenate([up, down, np.array(special, np.uint64)])


def patterns(src: str) -> np.ndarray:
    if src in ("F16", "BF16"):
        return np.arange(1 << 16, dtype=np.uint16)
    return _f32_boundaries() if src == "F32" else _f64_boundaries()


def torch_cast(bits: np.ndarray, src: str, dst: str) -> np.ndarray:
    """torch's bits for ``bits`` cast from src to dst, single-threaded, NaNs away from the
    end: its vectorised loop only (the scalar tail writes other NaN bits)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        padded = np.concatenate([bits, np.zeros(256, bits.dtype)])
        out = torch.from_numpy(padded).view(TORCH[src]).to(TORCH[dst])
        return out.view(torch.uint8).numpy().view(UINT[SIZE[dst]])[: len(bits)]
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(("src", "dst"), DIRECTIONS)
def test_converter_gives_torchs_bits(src, dst):
    """Bit for bit, NaNs too (as torch's vectorised loop writes them), and the same count
    of finite values that became infinite."""
    bits = patterns(src)
    out = np.empty(len(bits), UINT[SIZE[dst]])
    got_inf = Converter(block=4099).convert(src, dst, bits.copy().view(np.uint8), out.view(np.uint8))
    want = torch_cast(bits, src, dst)
    diff = np.nonzero(out != want)[0]
    assert len(diff) == 0, [(hex(bits[i]), hex(want[i]), hex(out[i])) for i in diff[:8]]
    a = torch.from_numpy(bits.copy()).view(TORCH[src])
    b = torch.from_numpy(want.copy()).view(TORCH[dst])
    assert got_inf == int((torch.isinf(b) & ~torch.isinf(a)).sum())
    assert (got_inf > 0) <= can_overflow(src, dst)


@pytest.mark.parametrize("dst", ["F16", "BF16"])
def test_f64_rounds_twice_like_torch(tmp_path, dst):
    # 1 + half a target ulp + a little: once rounded it goes up, through F32 it is a tie
    # that goes to even (down). torch rounds through F32; so must the caster.
    half = {"F16": 2.0**-11, "BF16": 2.0**-8}[dst]
    raw = np.array([1 + half + 2.0**-40] * 3, np.float64).tobytes()
    got, _ = cast_via_streamck(tmp_path, "F64", raw, dst)
    assert np.frombuffer(got, np.uint16).tolist() == [0x3C00 if dst == "F16" else 0x3F80] * 3
    raw = _f64_boundaries()[::7].tobytes()
    got, _ = cast_via_streamck(tmp_path, "F64", raw, dst, chunk=4096 * 8 + 24)
    assert np.array_equal(np.frombuffer(got, np.uint16), torch_cast(np.frombuffer(raw, np.uint64), "F64", dst))


def test_equal_but_nan_bits():
    f32 = np.array([1.0, np.nan, -np.nan, 0.0], np.float32)
    other = f32.copy()
    other.view(np.uint32)[1] = 0x7F800001  # another NaN
    assert equal_but_nan_bits(f32.tobytes(), other.tobytes(), "F32")
    other[3] = -0.0  # not a NaN: every bit counts
    assert not equal_but_nan_bits(f32.tobytes(), other.tobytes(), "F32")
    bf16 = np.array([0x3F80, 0x7FC0, 0xFFFF, 0x7F80], np.uint16)
    assert equal_but_nan_bits(bf16, np.array([0x3F80, 0xFFFF, 0x7F81, 0x7F80], np.uint16), "BF16")
    assert not equal_but_nan_bits(bf16, np.array([0x3F80, 0x7FC0, 0xFFFF, 0x7FC0], np.uint16), "BF16")  # inf != NaN


class _Stream:
    """A TensorStream stand-in: F32 values 0, 1, 2… that fails at byte ``fail_at``."""

    def __init__(self, numel: int, fail_at: int | None = None):
        self.ref = type("Ref", (), {"dtype": "F32", "numel": numel})()
        self.data = np.arange(numel, dtype=np.float32).tobytes()
        self.pos, self.fail_at = 0, fail_at

    def readinto(self, view: memoryview) -> int:
        n = min(len(view), len(self.data) - self.pos)
        if self.fail_at is not None and self.pos + n > self.fail_at:
            raise CheckpointError("file ended before its last tensor's bytes (truncated?)", "x.safetensors")
        view[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        return n


def _bf16(numel: int) -> bytes:
    return torch.arange(numel, dtype=torch.float32).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()


def test_read_ahead_keeps_order_and_survives_abandon_and_errors():
    caster = Caster(4096)
    assert b"".join(bytes(v) for v, _ in caster.convert(_Stream(10_000), "BF16")) == _bf16(10_000)
    steps = caster.convert(_Stream(10_000), "BF16")
    next(steps)  # the next step's read is under way
    steps.close()  # abandoned: no read may still fill a buffer afterwards
    with pytest.raises(CheckpointError, match="truncated"):  # raised in the reader thread, seen here
        for _ in caster.convert(_Stream(10_000, fail_at=3 * 4096), "BF16"):
            pass
    assert b"".join(bytes(v) for v, _ in caster.convert(_Stream(5_000), "BF16")) == _bf16(5_000)
    left = caster.convert(_Stream(10_000), "BF16")
    next(left)  # left unfinished, still referenced: the next tensor waits for its read
    second = caster.convert(_Stream(9_000), "BF16")
    first = bytes(next(second)[0])
    left.close()  # its cleanup leaves the second tensor's read alone
    assert first + b"".join(bytes(v) for v, _ in second) == _bf16(9_000)


def one_tensor(path: Path, dtype: str, raw: bytes) -> Path:
    n = len(raw) // SIZE[dtype]
    return raw_file(path, {"t": {"dtype": dtype, "shape": [n], "data_offsets": [0, len(raw)]}}, raw)


CHILD = """
import sys
sys.modules["torch"] = None  # import torch raises ImportError from here on
from streamck import Rules, compile_plan, open_checkpoint, write_plan
for src, dst, out in zip(*[iter(sys.argv[1:])] * 3):
    plan = compile_plan(open_checkpoint(src), Rules(dtype=dst))
    result = write_plan(plan, out, chunk=1 << 16, verify=True)
    print(result.overflow.get("t", 0))
assert sys.modules["torch"] is None
"""


def test_cast_without_torch_gives_the_same_bytes(tmp_path):
    """Every direction in a process where torch cannot be imported: the bytes of a cast with
    torch at hand (and torch's own, but for NaN bits in torch's scalar tail), same counts."""
    args, want = [], []
    for src, dst in DIRECTIONS:
        raw = patterns(src)[::5].tobytes()
        path = one_tensor(tmp_path / f"{src}-{dst}.safetensors", src, raw)
        args += [str(path), dst, str(tmp_path / f"no-torch-{src}-{dst}.safetensors")]
        want.append(cast_via_streamck(tmp_path, src, raw, dst, chunk=1 << 16))
    proc = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    counts = [int(line) for line in proc.stdout.split()]
    for (src, dst), (bytes_with_torch, overflow), count in zip(DIRECTIONS, want, counts, strict=True):
        got = bytes(open_checkpoint(tmp_path / f"no-torch-{src}-{dst}.safetensors").read("t"))
        assert got == bytes_with_torch, (src, dst)
        assert count == overflow, (src, dst)


def test_whole_rewrite_without_torch_matches_torch(tmp_path):
    """A multi-step F32→BF16 tensor through the CLI's own route, checked against torch."""
    values = np.random.default_rng(3).standard_normal(300_000).astype(np.float32)
    values[[5, 70_000, 200_001]] = [np.nan, np.inf, 3.4e38]
    raw = values.tobytes()
    src = one_tensor(tmp_path / "s.safetensors", "F32", raw)
    code = CHILD.replace("chunk=1 << 16", "chunk=1 << 18")
    proc = subprocess.run(
        [sys.executable, "-c", code, src, "BF16", tmp_path / "o.safetensors"], capture_output=True, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [b"1"]  # 3.4e38 rounds past BF16's largest; inf was already inf
    got = np.frombuffer(open_checkpoint(tmp_path / "o.safetensors").read("t"), np.uint16)
    want = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    ok = ~np.isnan(values)
    assert np.array_equal(got[ok], want[ok]) and got[5] & 0x7FFF > 0x7F80
    plan = compile_plan(open_checkpoint(src), Rules(dtype="bf16"))
    assert write_plan(plan, tmp_path / "p.safetensors").overflow == {"t": 1}
