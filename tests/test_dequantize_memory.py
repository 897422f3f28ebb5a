"""Dequantizing holds a band, not a tensor: peak RSS from the OS (VmHWM) of a child that rewrites one
large quantized tensor, over a child that only imports torch. A 256 MiB FineGrainedFP8 weight
(16384 × 16384, 128×128 F32 tiles, 512 MiB in bf16) within 64 MiB; a 126 MiB gpt-oss MXFP4 expert
tensor (gpt-oss-20b's down_proj: [32, 2880, 90, 16] blocks, 506 MiB in bf16) within 96 MiB.
bench/RESULTS.md records the figures."""

from __future__ import annotations

import json

import numpy as np
import pytest
from dequant_fixtures import peak_mib

torch = pytest.importorskip("torch")
from safetensors.torch import save_file  # noqa: E402

EXPERTS = "model.layers.0.mlp.experts.down_proj"


def _header(path) -> dict:
    with open(path, "rb") as f:
        return json.loads(f.read(int.from_bytes(f.read(8), "little")))


def _bytes(count: int, seed: int) -> np.ndarray:
    """``count`` pseudo-random bytes (E4M3 codes below 0x7F: no NaN; any E2M1 pair)."""
    return (np.arange(count, dtype=np.uint32) * 2654435761 + seed >> 24).astype(np.uint8)


def _peak_over_torch(src, out) -> float:
    torch_only = peak_mib("baseline")
    return peak_mib(str(src), str(out), "bf16") - torch_only


def test_fp8_256_mib_within_64_mib(tmp_path):
    n = 16384
    src, out = tmp_path / "fp8.safetensors", tmp_path / "out.safetensors"
    weight = torch.from_numpy((_bytes(n * n, 1) & 0x7E).reshape(n, n)).view(torch.float8_e4m3fn)
    save_file({"m.weight": weight, "m.weight_scale_inv": torch.full((n // 128, n // 128), 0.5)}, src)
    del weight
    over = _peak_over_torch(src, out)
    print(f"FP8 256 MiB -> bf16: {over:.1f} MiB over torch's import")
    assert _header(out)["m.weight"]["shape"] == [n, n]
    assert over < 64, over


def test_gptoss_mxfp4_126_mib_within_96_mib(tmp_path):
    e, h, i = 32, 2880, 2880
    src, out = tmp_path / "gptoss.safetensors", tmp_path / "out.safetensors"
    blocks = torch.from_numpy(_bytes(e * h * (i // 32) * 16, 2).reshape(e, h, i // 32, 16))
    scales = torch.full((e, h, i // 32), 127, dtype=torch.uint8)
    save_file({f"{EXPERTS}_blocks": blocks, f"{EXPERTS}_scales": scales}, src)
    del blocks
    over = _peak_over_torch(src, out)
    print(f"gpt-oss MXFP4 126 MiB -> bf16: {over:.1f} MiB over torch's import")
    assert _header(out)[EXPERTS]["shape"] == [e, i, h]
    assert over < 96, over
