"""Llama 3's RoPE scaling (``rope_type: "llama3"``, Llama 3.1 / 3.2 / 3.3): the reference writes
no key for it but an extra F32 tensor, ``rope_freqs.weight``, computed from the config
(``LlamaModel.generate_extra_tensors``), first in the file; llama.cpp divides each rotary
frequency by its factor.

The tensor has no source bytes: it is an OutputTensor whose transform (RopeFreqs) yields its
head_dim / 2 float32 values, computed here when the plan is made, so nothing else is held. Its
source names the config.json it comes from (its byte range is never read: a transform makes the
bytes).

The arithmetic is the reference's, operation for operation, in float32 as torch does it: torch's
``x / tensor`` is ``tensor.reciprocal() * x``, and a Python number meets a float32 tensor as
float32. One operation cannot be matched everywhere: ``base ** exponents``, which torch computes
with Sleef's vectorized pow (within 1 ulp, and per CPU), is computed here correctly rounded
(through float64); for Llama 3.x's own parameters the two agree (tests/test_gguf_rope.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from streamck.errors import PlanError
from streamck.plan import OutputTensor
from streamck.source.header import TensorRef
from streamck.transforms.base import OwnSource

LLAMA3 = "llama3"
NAME = "rope_freqs.weight"  # gguf.MODEL_TENSOR.ROPE_FREQS's name, as format_tensor_name gives it
# generate_extra_tensors's defaults where rope_parameters leaves a value out.
DEFAULTS = {"rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}  # fmt: skip


def is_llama3(params: dict[str, Any]) -> bool:
    """Whether the (full-attention) RoPE parameters are Llama 3's scaling."""
    return str(params.get("rope_type") or "").lower() == LLAMA3


def factors(params: dict[str, Any], hparams: dict[str, Any]) -> np.ndarray:
    """``generate_extra_tensors``'s factors: one float32 per rotary pair, 1 for short wavelengths,
    ``factor`` for long ones, smoothly between (see the module's note on pow)."""
    p = {k: params.get(k, d) for k, d in DEFAULTS.items()}
    dim = hparams.get("head_dim") or hparams["hidden_size"] // hparams["num_attention_heads"]
    f32 = np.float32
    exponents = np.arange(0, dim, 2, dtype=f32) / f32(dim)
    powers = np.power(np.float64(f32(p["rope_theta"])), exponents.astype(np.float64)).astype(f32)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        freqs = (f32(1) / powers) * f32(1.0)
        wavelen = (f32(1) / freqs) * f32(2 * math.pi)
        old, low, high, factor = (p[k] for k in ("original_max_position_embeddings", "low_freq_factor",
                                                 "high_freq_factor", "factor"))  # fmt: skip
        smooth = ((f32(1) / wavelen) * f32(old) - f32(low)) / f32(high - low)
        between = (f32(1) / ((f32(1) - smooth) / f32(factor) + smooth)) * f32(1)
    out = np.where(wavelen > f32(old / low), f32(factor), between)
    return np.where(wavelen < f32(old / high), f32(1), out).astype("<f4")


@dataclass(frozen=True)
class RopeFreqs(OwnSource):
    """The transform of the ``rope_freqs.weight`` tensor: its bytes, made from the config, no inputs."""

    data: bytes
    label: str = "llama3 RoPE"
    engine: str = "numpy"
    exact: bool = True

    def pieces(self, target, reader, space: dict) -> Iterator[memoryview]:
        yield memoryview(self.data)


def tensor(params: dict[str, Any], hparams: dict[str, Any], config: Path) -> OutputTensor:
    """The ``rope_freqs.weight`` OutputTensor for Llama 3 RoPE ``params``; its source names ``config``."""
    try:
        values = factors(params, hparams)
    except (TypeError, ValueError, KeyError) as e:
        raise PlanError(f"config.json's llama3 RoPE parameters: {e}", config) from None
    ref = TensorRef(NAME, "F32", values.shape, config, 0, values.nbytes)
    return OutputTensor(NAME, ref, "F32", RopeFreqs(values.tobytes()))
