"""The dequantize tests' shared fixture and case set-up: the native layouts beyond tests/quant_fixtures.py's
(built once per driver version by tests/dequant_oracles.py), and ``dequantized``, which runs streamck's
``--dtype`` and an oracle on one source and returns both outputs' tensors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import built_once, cli, fixture_root
from quant_fixtures import DRIVER as QUANT_DRIVER
from quant_fixtures import run_driver, run_oracle

HERE = Path(__file__).parent
DRIVER = HERE / "dequant_oracles.py"
TORCH = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}


def run_dequant_oracle(*args) -> None:
    run_driver(DRIVER, *args)


@pytest.fixture(scope="session")
def native(tmp_path_factory, quant) -> Path:
    """A folder of the native layouts: ``gptoss`` (MXFP4 experts) with transformers' dequantized load of
    it (``gptoss-bf16.safetensors``, ``gptoss-f32.safetensors``); ``ct128`` (model_free_ptq FP8_BLOCK of a
    Llama whose weights are 128 columns wide or less); ``fp8-partial`` and ``moe-fp8`` (FineGrainedFP8 with
    partial tiles, and per expert: tests/dequant_oracles.py relabel); ``ue8m0`` (E8M0 scales)."""
    root = fixture_root(tmp_path_factory, "dequant", DRIVER, QUANT_DRIVER, HERE / "quant_fixtures.py")

    def build(tmp: Path) -> None:
        run_dequant_oracle("gptoss", tmp / "gptoss")
        for dtype in ("bf16", "f32"):
            run_dequant_oracle("gptoss_load", tmp / "gptoss", TORCH[dtype], tmp / f"gptoss-{dtype}.safetensors")
        run_dequant_oracle("base128", tmp / "llama128")
        run_oracle("ptq", tmp / "llama128", tmp / "ct128", "FP8_BLOCK", "lm_head")
        run_dequant_oracle("relabel", quant / "llama-FP8_BLOCK", tmp / "fp8-partial")
        run_dequant_oracle("relabel", quant / "qwen3moe-FP8_BLOCK", tmp / "moe-fp8")
        run_dequant_oracle("ue8m0", quant / "llama384", tmp / "ue8m0")

    return built_once(root / "dequant", build)


def dequantized(src: Path, dtype: str, tmp: Path, oracle: str, *flags: str) -> tuple[dict, dict]:
    """streamck ``rewrite SRC --dtype DTYPE --verify`` (and ``flags``) and the ``oracle`` command
    (quant_oracles' ``load`` or ``decompress``, dequant_oracles' ``fp8_ops`` or ``decompress``: "ct-" names
    the latter) on ``src``: (our tensors, the oracle's), by name."""
    from safetensors.torch import load_file

    cli("rewrite", src, "-o", tmp / "out", "--dtype", dtype, "--verify", *flags, check=0)
    ours = {k: v for p in sorted((tmp / "out").glob("*.safetensors")) for k, v in load_file(p).items()}
    if oracle in ("fp8_ops", "ct-decompress"):
        run_dequant_oracle(oracle.removeprefix("ct-"), src, TORCH[dtype], tmp / "oracle.safetensors")
    else:
        run_oracle(oracle, src, TORCH[dtype], tmp / "oracle.safetensors")
    return ours, load_file(tmp / "oracle.safetensors")


def same(a, b) -> bool:
    """Bit for bit: dtype, shape and bytes."""
    import torch

    bits = (t.contiguous().view(-1).view(torch.uint8) for t in (a, b))
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(*bits)


PEAK_CHILD = """
import sys
import torch
if sys.argv[1] != "baseline":
    from streamck import rewrite
    rewrite(sys.argv[1], sys.argv[2], dtype=sys.argv[3])
print(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")))
"""


def peak_mib(*args: str) -> float:
    """The peak RSS (the OS's VmHWM) in MiB of a child that imports torch and, unless ``args`` is
    ("baseline",), rewrites SRC to OUT with ``--dtype`` DTYPE (``args``: SRC OUT DTYPE)."""
    child = subprocess.run([sys.executable, "-c", PEAK_CHILD, *args], capture_output=True, text=True)
    assert child.returncode == 0, child.stderr
    return int(child.stdout.split()[-1]) / 1024
