"""FP4 rounding by table (streamck.transforms.fp4.E2M1) against compressed-tensors 0.19's own
cast_to_fp4 + pack_fp4_to_uint8 (what model_free_ptq runs on the CPU): every class of float32 bit
patterns the table tells apart (sign, exponent, two mantissa bits; the rest zero, one, all ones and
random: the ties are the classes' least members), and every bfloat16 and float16 pattern (MXFP4
divides in the weight's dtype). NaNs never reach the table (a band holding one takes compressed-
tensors' own operations, tests/test_quantize.py's nan cases); ±inf and values beyond 6 do (6.0)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("compressed_tensors")


def ct_nibbles(x: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' nibble for each value: clamped, rounded by cast_to_fp4 in x's dtype,
    packed beside a zero (the low nibble is the value's)."""
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8
    from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4

    rounded = cast_to_fp4(torch.clamp(x, -6.0, 6.0).clone())
    pairs = torch.stack([rounded, torch.zeros_like(rounded)], dim=-1).reshape(1, -1)
    return pack_fp4_to_uint8(pairs).flatten() & 0xF


def table_nibbles(x: torch.Tensor) -> torch.Tensor:
    """streamck's nibbles for x (one group whose scale is 1: the quotient is x itself)."""
    from streamck.transforms.fp4 import _fp4_group

    return _fp4_group(x.reshape(1, -1), torch.ones(1, 1, dtype=x.dtype)).flatten()


def test_every_float32_class():
    from streamck.transforms.fp4 import CUT, E2M1, NAN

    assert len(E2M1) == 4096 and max(E2M1) == NAN
    high = torch.arange(1 << (32 - CUT), dtype=torch.int64) << CUT
    rest = [torch.zeros_like(high), torch.ones_like(high), torch.full_like(high, (1 << CUT) - 1),
            torch.randint(1, 1 << CUT, high.shape, generator=torch.Generator().manual_seed(0))]  # fmt: skip
    bits = torch.cat([high | r for r in rest])
    x = ((bits + (1 << 31)) % (1 << 32) - (1 << 31)).to(torch.int32).view(torch.float32)
    x = x[~torch.isnan(x)]
    assert x.numel() > 8000 and torch.isinf(x).sum() == 2
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert torch.isin(x, ties).sum() == 7 and torch.isin(x, -ties).sum() == 7
    assert torch.equal(table_nibbles(x), ct_nibbles(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_16_bit_pattern(dtype):
    x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    x = x[~torch.isnan(x)]
    assert torch.equal(table_nibbles(x), ct_nibbles(x))


def test_nan_band_takes_the_reference():
    """A band with a NaN gives compressed-tensors' nibbles for the NaN too (whatever their sign)."""
    x = torch.tensor([0.25, float("nan"), -0.0, -0.1, float("inf"), -float("inf"), 5.0, -float("nan")])
    assert torch.equal(table_nibbles(x), ct_nibbles(x))
