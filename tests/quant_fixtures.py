"""The quantization tests' shared fixtures: bases and oracle outputs, built once per driver version."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import built_once, fixture_root

HERE = Path(__file__).parent
DRIVER = HERE / "quant_oracles.py"


def run_driver(driver: Path, *args) -> None:
    """``python DRIVER ARGS`` in a child (one thread, no progress bars), bounded; its stderr in the error."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    done = subprocess.run([sys.executable, str(driver), *map(str, args)], env=env, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"{driver.name} {args[0]} failed:\n{done.stderr[-6000:]}")


def run_oracle(*args) -> None:
    run_driver(DRIVER, *args)


# streamck's default ignore list for these bases (the head, the embeddings, a MoE router)
ROUTER = "re:.*mlp.gate$"
DEFAULT = ("lm_head", "model.embed_tokens", ROUTER)
# (case name, base, scheme, ignore entries) that model_free_ptq is run on once
PTQ_CASES = [
    ("llama-FP8_DYNAMIC", "llama", "FP8_DYNAMIC", DEFAULT),
    ("llama-FP8_BLOCK", "llama", "FP8_BLOCK", DEFAULT),
    ("sharded-FP8_BLOCK", "llama-sharded", "FP8_BLOCK", DEFAULT),
    ("qwen3moe-FP8_DYNAMIC", "qwen3moe", "FP8_DYNAMIC", DEFAULT),
    ("qwen3moe-FP8_BLOCK", "qwen3moe", "FP8_BLOCK", DEFAULT[1:]),  # --quantize-lm-head
    ("llama-NVFP4A16", "llama", "NVFP4A16", DEFAULT),
    ("qwen3moe-NVFP4A16", "qwen3moe", "NVFP4A16", DEFAULT),
    ("llama-MXFP4A16", "llama", "MXFP4A16", DEFAULT),
    ("qwen3moe-MXFP4A16", "qwen3moe", "MXFP4A16", (*DEFAULT, "re:.*self_attn.o_proj$")),
    ("tied-FP8_BLOCK", "llama-tied", "FP8_BLOCK", DEFAULT),
    ("ct-FP8_DYNAMIC", "llama", "FP8_DYNAMIC", ("lm_head", "model.embed_tokens")),
    # NaN and ±inf weights (no embeddings: none in the defaults)
    *((f"nan-{s}", "nan", s, ("lm_head", ROUTER)) for s in ("FP8_DYNAMIC", "FP8_BLOCK", "NVFP4A16", "MXFP4A16")),
]


@pytest.fixture(scope="session")
def quant(request, tmp_path_factory) -> Path:
    """A folder holding the bases (llama, llama-sharded, llama-split, llama384, llama-tied, qwen3moe, nan),
    model_free_ptq's outputs
    (PTQ_CASES, by case name) and a DeepSeek-layout FP8 llama (ds-fp8)."""
    pytest.importorskip("llmcompressor", reason="llmcompressor==0.14.0.1 (scripts/test installs it)")
    digest = hashlib.sha256(DRIVER.read_bytes() + repr(PTQ_CASES).encode()).hexdigest()[:12]
    root = fixture_root(tmp_path_factory, "quant", DRIVER, Path(__file__))

    def build(tmp: Path) -> None:
        run_oracle("bases", tmp)
        for case, base, scheme, ignore in PTQ_CASES:
            run_oracle("ptq", tmp / base, tmp / case, scheme, *ignore)
        run_oracle("fp8", tmp / "llama384", tmp / "ds-fp8")

    return built_once(root / f"quant-{digest}", build)
