"""Casts give exactly the bits of torch's CPU Tensor.to(), chunk by chunk."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import raw_file
from hypothesis import given, settings
from hypothesis import strategies as st

from streamck import PlanError, Rule, Rules, compile_plan, open_checkpoint, write_plan

TORCH = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
BITS = {"F64": torch.int64, "F32": torch.int32, "F16": torch.int16, "BF16": torch.int16}


def cast_via_streamck(tmp_path, src_dtype: str, raw: bytes, dst_dtype: str, chunk: int = 1 << 20, device="cpu"):
    """Write ``raw`` as one tensor, rewrite it with --dtype, return (output bytes, overflow)."""
    itemsize = torch.empty(0, dtype=TORCH[src_dtype]).element_size()
    n = len(raw) // itemsize
    src = raw_file(
        tmp_path / f"src-{src_dtype}-{dst_dtype}.safetensors",
        {"t": {"dtype": src_dtype, "shape": [n], "data_offsets": [0, len(raw)]}},
        raw,
    )
    out = tmp_path / f"out-{src_dtype}-{dst_dtype}.safetensors"
    plan = compile_plan(open_checkpoint(src), Rules(dtype=dst_dtype))
    result = write_plan(plan, out, chunk=chunk, force=True, device=device)
    return bytes(open_checkpoint(out).read("t")), result.overflow.get("t", 0)


def assert_same_as_torch(got: bytes, src_dtype: str, raw: bytes, dst_dtype: str) -> None:
    """Bit-identical to ``Tensor.to`` for every value but NaNs; NaNs stay NaN.

    torch's own NaN payloads are not stable: its vectorised loop quiets a signalling
    NaN (F16 0x7C1E -> F32 0x7FC3C000) where its scalar tail loop gives 0x7FFFFFFF,
    so the bits of a NaN (its sign too) depend on where it sits in the tensor and on
    the thread split.
    """
    src = torch.frombuffer(bytearray(raw), dtype=TORCH[src_dtype]) if raw else torch.empty(0, dtype=TORCH[src_dtype])
    want = src.to(TORCH[dst_dtype])
    out = torch.frombuffer(bytearray(got), dtype=TORCH[dst_dtype]) if got else torch.empty(0, dtype=TORCH[dst_dtype])
    assert out.shape == want.shape
    nan = torch.isnan(src)
    assert torch.equal(out.view(BITS[dst_dtype])[~nan], want.view(BITS[dst_dtype])[~nan])
    assert bool(torch.isnan(out[nan]).all())


ALL_16 = np.arange(1 << 16, dtype=np.uint16).tobytes()


@pytest.mark.parametrize(("src", "dst"), [(s, d) for s in ("F16", "BF16") for d in TORCH if d != s])
def test_every_16_bit_pattern(tmp_path, src, dst):
    got, _ = cast_via_streamck(tmp_path, src, ALL_16, dst, chunk=4096 + 6)
    assert_same_as_torch(got, src, ALL_16, dst)


def _f32_ties() -> bytes:
    # Every rounding boundary of F32 -> BF16 (low 16 bits) and F32 -> F16 (low 13 bits
    # for normals), for many high parts: exponents across normals, subnormals, the
    # F16 overflow edge, infinities and NaNs, both signs, even and odd kept LSBs.
    highs = np.arange(0, 1 << 16, 37, dtype=np.uint32)
    lows = np.array([0, 1, 0x0FFF, 0x1000, 0x1001, 0x1FFF, 0x2000, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)
    patterns = (highs[:, None] << 16 | lows[None, :]).ravel()
    specials = np.array(
        [
            0x477FE000,
            0x477FEFFF,
            0x477FF000,
            0x477FF001,
            0x7F7FFFFF,
            0x7F7F8000,
            0x7F7F7FFF,
            0x33000000,
            0x33000001,
            0x387FE000,
            0x00000001,
            0x80000001,
            0x7F800001,
            0xFFC00000,
        ],
        np.uint32,
    )
    return np.concatenate([patterns, specials]).tobytes()


@pytest.mark.parametrize("dst", ["BF16", "F16", "F64"])
def test_f32_rounding_boundaries(tmp_path, dst):
    raw = _f32_ties()
    got, _ = cast_via_streamck(tmp_path, "F32", raw, dst, chunk=1000)
    assert_same_as_torch(got, "F32", raw, dst)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, (1 << 32) - 1), min_size=0, max_size=300), st.sampled_from(["BF16", "F16", "F64"]))
def test_random_f32_bit_patterns(tmp_path_factory, words, dst):
    raw = np.array(words, dtype=np.uint32).tobytes()
    got, _ = cast_via_streamck(tmp_path_factory.mktemp("h"), "F32", raw, dst, chunk=64)
    assert_same_as_torch(got, "F32", raw, dst)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, (1 << 64) - 1), min_size=1, max_size=200), st.sampled_from(["F32", "BF16", "F16"]))
def test_random_f64_bit_patterns(tmp_path_factory, words, dst):
    raw = np.array(words, dtype=np.uint64).tobytes()
    got, _ = cast_via_streamck(tmp_path_factory.mktemp("h"), "F64", raw, dst, chunk=72)
    assert_same_as_torch(got, "F64", raw, dst)


def test_size_not_a_multiple_of_the_chunk(tmp_path):
    raw = np.random.default_rng(1).standard_normal(12345, dtype=np.float32).tobytes()
    for chunk in (4, 1000, 4096 * 3 + 4, 1 << 20):
        got, _ = cast_via_streamck(tmp_path, "F32", raw, "BF16", chunk=chunk)
        assert_same_as_torch(got, "F32", raw, "BF16")


def test_overflow_counted(tmp_path):
    raw = np.array([1e5, -1e5, np.inf, 1.0, np.nan, 65504, 65520], np.float32).tobytes()
    _, overflow = cast_via_streamck(tmp_path, "F32", raw, "F16")
    assert overflow == 3  # 1e5, -1e5, 65520; inf was already inf
    _, widen = cast_via_streamck(tmp_path, "F32", raw, "F64")
    assert widen == 0


def _mixed(tmp_path):
    f32 = np.arange(4, dtype=np.float32)
    header = {
        "a.norm.weight": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "b.weight": {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]},
        "c.step": {"dtype": "I64", "shape": [1], "data_offsets": [32, 40]},
    }
    return raw_file(tmp_path / "m.safetensors", header, f32.tobytes() * 2 + np.int64(7).tobytes())


def test_cast_rules_precedence(tmp_path):
    ckpt = open_checkpoint(_mixed(tmp_path))
    rules = Rules((Rule("cast", "*norm*=fp32"), Rule("cast", "a.*=f16"), Rule("cast", "b.*=float64")), "bf16")
    dtypes = {t.name: t.dtype for t in compile_plan(ckpt, rules).tensors}
    assert dtypes == {"a.norm.weight": "F16", "b.weight": "F64", "c.step": "I64"}
    plain = {t.name: t.dtype for t in compile_plan(ckpt, Rules(dtype="half")).tensors}
    assert plain == {"a.norm.weight": "F16", "b.weight": "F16", "c.step": "I64"}


def test_cast_naming_an_integer_tensor_is_an_error(tmp_path):
    with pytest.raises(PlanError, match="'c.step', an I64 tensor, which is never cast"):
        compile_plan(open_checkpoint(_mixed(tmp_path)), Rules((Rule("cast", "c.*=bf16"),)))


def test_dtype_spellings():
    from streamck.dtypes import castable_dtype

    spellings = {
        "F32": ["F32", "float32", "fp32"],
        "BF16": ["BF16", "bfloat16", "bf16"],
        "F16": ["F16", "float16", "fp16", "half"],
        "F64": ["F64", "float64"],
    }
    for name, words in spellings.items():
        assert all(castable_dtype(w) == name for w in words)
    with pytest.raises(ValueError, match="int8"):
        castable_dtype("int8")


def streamck(*args):
    return subprocess.run([sys.executable, "-m", "streamck", *map(str, args)], capture_output=True, text=True)


def test_cli_reports_overflow_per_tensor(tmp_path):
    raw = np.array([1e5, 2e5, 1.0], np.float32).tobytes()
    src = raw_file(tmp_path / "s.safetensors", {"big": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}}, raw)
    proc = streamck("rewrite", src, "-o", tmp_path / "o.safetensors", "--dtype", "fp16")
    assert proc.returncode == 0, proc.stderr
    assert "big: 2 finite values became inf" in proc.stderr
    proc = streamck("rewrite", src, "-o", tmp_path / "j.safetensors", "--dtype", "fp16", "--json")
    assert json.loads(proc.stdout)["overflow"] == {"big": 2}


def test_cli_dry_run_shows_dtypes(tmp_path):
    proc = streamck("rewrite", _mixed(tmp_path), "--dry-run", "--dtype", "bf16", "--cast", "*norm*=fp32")
    assert "F32->BF16" in proc.stdout and "c.step" in proc.stdout
    assert "a.norm.weight  a.norm.weight  F32 " in proc.stdout


def _with_config(tmp_path, config: str):
    src = tmp_path / "ck"
    src.mkdir(parents=True)
    _mixed(src).rename(src / "model.safetensors")
    (src / "config.json").write_text(config)
    return src


HF_CONFIG = """{
  "architectures": [
    "LlamaForCausalLM"
  ],
  "rms_norm_eps": 1e-05,
  "torch_dtype": "float32",
  "dtype": "float32",
  "vocab_size": 8
}
"""


def test_dtype_cast_relabels_a_copied_config(tmp_path):
    # Loaders take the compute dtype from config.json: bf16 weights labelled float32 would
    # be served in float16 or float32. Everything else in the file stays as it was.
    src = _with_config(tmp_path, HF_CONFIG)
    dry = streamck("rewrite", src, "--dry-run", "--dtype", "bf16")
    assert "config.json: torch_dtype float32 -> bfloat16" in dry.stdout
    assert "config.json: dtype float32 -> bfloat16" in dry.stdout
    proc = streamck("rewrite", src, "-o", tmp_path / "out", "--dtype", "bf16", "--cast", "*norm*=fp32")
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "out" / "config.json").read_text()
    assert text == HF_CONFIG.replace('"float32"', '"bfloat16"')  # written as transformers writes it
    odd = _with_config(tmp_path / "odd", '{"torch_dtype":"float32","layers":[1,2],"sub":{"torch_dtype":"float32"}}')
    assert streamck("rewrite", odd, "-o", tmp_path / "odd-out", "--dtype", "fp16").returncode == 0
    want = {"torch_dtype": "float16", "layers": [1, 2], "sub": {"torch_dtype": "float32"}}
    got = json.loads((tmp_path / "odd-out" / "config.json").read_text())
    assert got == want and list(got) == list(want)


@pytest.mark.parametrize(
    ("config", "args"),
    [
        (HF_CONFIG, ["--cast", "*.weight=bf16"]),  # only --dtype says what the whole model is
        (HF_CONFIG, ["--strip-prefix", "x."]),  # no cast at all
        (HF_CONFIG.replace("float32", "bfloat16"), ["--dtype", "bf16"]),  # already right
        ('{"hidden_size": 4}', ["--dtype", "bf16"]),  # names no dtype
        ("{not json", ["--dtype", "bf16"]),  # not ours to judge
        ('["a list"]', ["--dtype", "bf16"]),
        ('{"torch_dtype": {"vision": "float32"}}', ["--dtype", "bf16"]),
    ],
)
def test_config_copied_byte_for_byte_otherwise(tmp_path, config, args):
    src = _with_config(tmp_path, config)
    proc = streamck("rewrite", src, "-o", tmp_path / "out", *args)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / "config.json").read_text() == config


def test_single_file_output_of_a_dir_with_config(tmp_path):
    src = _with_config(tmp_path, HF_CONFIG)
    proc = streamck("rewrite", src, "-o", tmp_path / "one.safetensors", "--dtype", "bf16")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "one.safetensors"]
