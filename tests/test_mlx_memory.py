"""MLX output from a quantized source holds a band, not a tensor (#51): peak RSS from the OS (VmHWM)
of a child that writes MLX_Q4 from an FP8 source (compressed-tensors, per row), over its own peak
once it has imported torch and streamck. Its Qwen3-MoE layer's three expert stacks (8 experts of 2048 × 4096
each: 64 MiB of E4M3 a stack, 128 MiB once dequantized to bf16) and a dense 8192 × 8192 weight
(64 MiB, 128 MiB in bf16) are each dequantized and quantized a band at a time: the peak stays under
96 MiB over the import, where one dequantized tensor alone would be 128 MiB. (Each value's bits: tests/test_mlx.py.)"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from safetensors.torch import save_file  # noqa: E402

EXPERTS, HIDDEN, INTER = 8, 4096, 2048
PROJS = {"gate_proj": (INTER, HIDDEN), "up_proj": (INTER, HIDDEN), "down_proj": (HIDDEN, INTER)}
DENSE = 8192
# One child: its high-water mark after the imports, then after the rewrite (KiB, one line each).
CHILD = """
import sys
import torch
import streamck
def peak():
    print(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")))
peak()
streamck.rewrite(sys.argv[1], sys.argv[2], format="mlx", quantize="MLX_Q4")
peak()
"""
CONFIG = {
    "model_type": "qwen3_moe",
    "num_experts": EXPERTS,
    "num_hidden_layers": 1,
    "hidden_size": HIDDEN,
    "dtype": "bfloat16",
    "quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized"},
}


def _peak_over_import_mib(*args: str) -> float:
    child = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-2000:]
    imported, written = map(int, child.stdout.split()[-2:])
    return (written - imported) / 1024


def _e4m3(shape: tuple[int, ...], seed: int):
    """Pseudo-random E4M3 codes below 0x7F (no NaN), as a float8 tensor."""
    count = int(np.prod(shape))
    codes = ((np.arange(count, dtype=np.uint32) * 2654435761 + seed) >> 24).astype(np.uint8) & 0x7E
    return torch.from_numpy(codes.reshape(shape)).view(torch.float8_e4m3fn)


def _source(folder) -> None:
    """The FP8 source: config.json, and one file of the experts' and the dense weight with their row scales."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    tensors = {}
    for e in range(EXPERTS):
        for i, (proj, shape) in enumerate(PROJS.items()):
            name = f"model.layers.0.mlp.experts.{e}.{proj}"
            tensors[f"{name}.weight"] = _e4m3(shape, 3 * e + i)
            tensors[f"{name}.weight_scale"] = torch.full((shape[0], 1), 0.01 * (e + 1), dtype=torch.bfloat16)
    tensors["model.layers.0.mlp.gate.weight"] = torch.zeros((EXPERTS, HIDDEN), dtype=torch.bfloat16)  # the router
    tensors["model.layers.0.self_attn.o_proj.weight"] = _e4m3((DENSE, DENSE), 99)
    tensors["model.layers.0.self_attn.o_proj.weight_scale"] = torch.full((DENSE, 1), 0.02, dtype=torch.bfloat16)
    save_file(tensors, folder / "model.safetensors")


def test_fp8_source_to_mlx_q4_within_96_mib(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    _source(src)
    over = _peak_over_import_mib(str(src), str(out))
    print(f"FP8 (three 64 MiB expert stacks, a 64 MiB weight) -> MLX_Q4: {over:.1f} MiB over the import")
    with open(out / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    stack = "model.layers.0.mlp.switch_mlp.down_proj"
    weight = header[f"{stack}.weight"]
    assert (weight["dtype"], weight["shape"]) == ("U32", [EXPERTS, HIDDEN, INTER // 8])
    assert header[f"{stack}.scales"]["shape"] == [EXPERTS, HIDDEN, INTER // 64]
    assert header["model.layers.0.self_attn.o_proj.biases"]["dtype"] == "BF16"
    assert over < 96, over
