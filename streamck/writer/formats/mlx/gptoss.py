"""gpt-oss (``model_type`` gpt_oss) for MLX output: its fused experts as mlx-lm 0.32.2's
``gpt_oss.Model.sanitize`` leaves them, one expert's slice at a time.

A transformers checkpoint holds ``<layer>.mlp.experts.gate_up_proj`` [E, H, 2I] (gate and up
columns interleaved: gate at the even columns), ``down_proj`` [E, I, H] and their biases
``gate_up_proj_bias`` [E, 2I], ``down_proj_bias`` [E, H]. MLX's ``SwitchGLU`` holds
``experts.{gate,up,down}_proj.weight`` as [E, out, in] with a bias each: the gate's weight is each
expert's even columns, transposed ([E, I, H]), the up's the odd ones, the down's the expert
transposed ([E, H, I]); the gate's bias the even values of ``gate_up_proj_bias``, the up's the odd.
(mlx-lm's sanitize splits rows ``::2`` of an [E, 2I, H] weight; transformers stores it [E, H, 2I],
which mlx_lm.convert itself refuses: it converts the published MXFP4 layout only.)

The published MXFP4 layout (``quant_method: mxfp4``) stays packed, as mlx-lm keeps it:
``gate_up_proj_blocks`` U8 [E, 2I, G, 16] becomes ``gate_proj.weight`` (its even rows) and
``up_proj.weight`` (the odd ones) as U32 [E, I, G × 4] (the same bytes, four to a word), with
``gate_up_proj_scales`` U8 [E, 2I, G] split the same way into ``.scales``; ``down_proj_blocks``
and ``down_proj_scales`` are ``down_proj.weight`` and ``.scales`` byte for byte. The config says
``quantization`` {group_size 32, bits 4, mode mxfp4}; with ``-q`` every other quantized module is
recorded in it by name (mlx-lm's fine-grained config), the experts left as they are.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from streamck.errors import OutputError, PlanError
from streamck.plan import OutputTensor, Plan
from streamck.source.reader import Reader
from streamck.transforms.base import OwnSource
from streamck.transforms.mlx_quant import as_float32, from_float32

# <layer>.mlp.experts . projection, and what of it: the weight (none), its bias, MXFP4 blocks or scales
EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")
MXFP4 = {"group_size": 32, "bits": 4, "mode": "mxfp4"}  # load_model's for quant_method mxfp4
HALVES = (("gate_proj", 0), ("up_proj", 1))  # gate_up_proj's interleaved halves: (name, first index)
_ITEM = {1: np.uint8, 2: np.uint16, 4: np.uint32}
_SIZES = {"U8": 1, "BF16": 2, "F16": 2, "F32": 4}
FLOATS = ("F32", "F16", "BF16")
BAND_BYTES = 4 << 20  # a band of an expert's rows read at a time


@dataclass(frozen=True, slots=True)
class ExpertSlices(OwnSource):
    """A stack computed from a fused one [E, rows, cols], one expert's slice at a time: each
    slice's rows (``axis`` 0) or columns (``axis`` 1) ``start::2`` (``axis`` None: all of them),
    transposed with ``transpose``; cast to the output's dtype where that differs from the
    source's (floats only, rounded to nearest even, as MLX's ``astype``). The source is read
    BAND_BYTES of rows at a time; a transposed expert is held whole once (its output slice)."""

    rows: int
    cols: int
    axis: int | None
    start: int = 0
    transpose: bool = False
    engine: str = "numpy"
    exact: bool = True

    @property
    def label(self) -> str:
        pick = {None: "", 0: f"rows {self.start}::2", 1: f"columns {self.start}::2"}[self.axis]
        what = ", ".join(p for p in (pick, "transposed" if self.transpose else "") if p)
        return f"gpt-oss experts {what or 'as stored'}"

    def pieces(self, target, reader: Reader, space: dict) -> Iterator[memoryview]:
        """Each expert's output slice in turn, read a band of its rows at a time: a band's picked
        values as they come, or (transposed) gathered into the expert's output slice first."""
        ref = target.source
        values = _ITEM[_SIZES[ref.dtype]]
        stream = reader.stream(ref)
        step = max(1, BAND_BYTES // (self.cols * _SIZES[ref.dtype]))
        for e in range(ref.shape[0]):
            slice_ = None
            for r in range(0, self.rows, step):
                n = min(step, self.rows - r)
                buf = bytearray(n * self.cols * _SIZES[ref.dtype])
                if stream.readinto(memoryview(buf)) != len(buf):
                    raise OutputError(f"{ref.name}: its source ended in expert {e}", ref.path)
                x = np.frombuffer(buf, dtype=values).reshape(n, self.cols)
                if self.axis is not None:  # a band's rows of the picked parity, whatever row it starts at
                    x = x[(self.start - r) % 2 :: 2] if self.axis == 0 else x[:, self.start :: 2]
                if not self.transpose:
                    yield self._held(x, ref.dtype, target.dtype)
                    continue
                if slice_ is None:
                    slice_ = np.empty((x.shape[1], self.rows), values)
                slice_[:, r : r + n] = x.T
            if slice_ is not None:
                yield self._held(slice_, ref.dtype, target.dtype)

    @staticmethod
    def _held(x: np.ndarray, stored: str, dtype: str) -> memoryview:
        """``x``'s bytes, cast where the output holds another float dtype (``--dtype``)."""
        x = np.ascontiguousarray(x)
        if dtype != stored and dtype in FLOATS:
            x = np.ascontiguousarray(from_float32(as_float32(x, stored), dtype))
        return memoryview(x).cast("B")


def native_quantization(plan: Plan, config: dict[str, Any]) -> dict | None:
    """The published MXFP4 layout's ``quantization`` (its ``quantization_config`` then leaves
    ``config``, as load_model replaces it); None for a source without ``*_blocks`` experts."""
    if plan.source is None or not any(_blocks(n) for n in plan.source.tensors):
        return None
    qc = config.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != "mxfp4":
        raise PlanError("gpt-oss experts stored as MXFP4 blocks need config.json's quantization_config "
                        "quant_method mxfp4 (mlx-lm reads them by it)")  # fmt: skip
    config.pop("quantization_config")
    return dict(MXFP4)


def _blocks(name: str) -> bool:
    m = EXPERTS.match(name)
    return m is not None and m[3] == "_blocks"


def sanitized(tensors: list[OutputTensor], config: dict[str, Any]) -> list[OutputTensor]:
    """``tensors`` with each fused expert tensor as the ones sanitize makes of it."""
    experts = config.get("num_local_experts")
    shapes = {t.name: t.shape for t in tensors}
    out = []
    for t in tensors:
        m = EXPERTS.match(t.name)
        if m is None:
            out.append(t)
            continue
        scales = f"{m[1]}.{m[2]}_scales"
        if m[3] == "_blocks" and shapes.get(scales) != t.shape[:3]:
            said = f"is {list(shapes[scales])}" if scales in shapes else "is missing"
            raise PlanError(f"{t.name} {list(t.shape)} needs {scales} {list(t.shape[:3])} beside it, which {said}")
        if t.transform is not None or not t.shape or t.shape[0] != experts:
            what = f"is computed ({t.transform.label})" if t.transform is not None else f"is {list(t.shape)}"
            raise PlanError(f"{t.name} {what}: MLX output reads gpt-oss experts as transformers or the "
                            f"published MXFP4 checkpoint stores them ({experts} experts first)")  # fmt: skip
        out += _split(t, m[1], m[2], m[3] or "")
    return out


def _split(t: OutputTensor, block: str, proj: str, part: str) -> list[OutputTensor]:
    """What sanitize makes of ``<block>.<proj><part>``."""
    if proj == "down_proj":
        return [_down(t, block, part)]
    shape, ref = t.shape, t.source
    _check(t, {"": 3, "_bias": 2, "_blocks": 4, "_scales": 3}[part], part)
    out = []
    for name, start in HALVES:
        if part == "_bias":
            transform = ExpertSlices(1, shape[1], 1, start)
            out.append(OutputTensor(f"{block}.{name}.bias", ref, t.dtype, transform, (shape[0], shape[1] // 2)))
        elif part == "":  # [E, H, 2I]: the half's columns, as [E, I, H]
            transform = ExpertSlices(shape[1], shape[2], 1, start, transpose=True)
            out.append(
                OutputTensor(f"{block}.{name}.weight", ref, t.dtype, transform, (shape[0], shape[2] // 2, shape[1]))
            )
        else:  # MXFP4 blocks [E, 2I, G, 16] or scales [E, 2I, G]: the half's rows, bytes as they are
            row = math.prod(shape[2:])
            kind, last = ("U32", row // 4) if part == "_blocks" else ("U8", row)
            transform = ExpertSlices(shape[1], row, 0, start)
            leaf = "weight" if part == "_blocks" else "scales"
            out.append(OutputTensor(f"{block}.{name}.{leaf}", ref, kind, transform, (shape[0], shape[1] // 2, last)))
    return out


def _down(t: OutputTensor, block: str, part: str) -> OutputTensor:
    """``down_proj`` [E, I, H] transposed to [E, H, I]; its bias, blocks (as U32 words) and scales as stored."""
    shape, ref = t.shape, t.source
    _check(t, {"": 3, "_bias": 2, "_blocks": 4, "_scales": 3}[part], part)
    if part == "":
        return OutputTensor(f"{block}.down_proj.weight", ref, t.dtype, ExpertSlices(shape[1], shape[2], None, 0, True),
                            (shape[0], shape[2], shape[1]))  # fmt: skip
    if part == "_blocks":  # the same bytes, four to a uint32 word (mx's view)
        words = (*shape[:2], shape[2] * shape[3] // 4)
        if ref.tiles is None and ref.strides is None and ref.parts is None:  # lying whole in its file: copied
            return OutputTensor(f"{block}.down_proj.weight", ref._replace(dtype="U32", shape=words), "U32")
        # in blocks (a DCP save), whose boxes are in the bytes' own shape: streamed as they come
        return OutputTensor(f"{block}.down_proj.weight", ref, "U32", ExpertSlices(shape[1], words[2] * 4, None), words)
    leaf = "bias" if part == "_bias" else "scales"
    return OutputTensor(f"{block}.down_proj.{leaf}", ref, t.dtype)


def _check(t: OutputTensor, rank: int, part: str) -> None:
    """PlanError unless ``t`` has ``rank`` axes of the dtype its part is stored in."""
    packed = part in ("_blocks", "_scales")
    ok = len(t.shape) == rank and ((t.source.dtype == "U8") if packed else t.source.dtype in FLOATS)
    if ok and part == "_blocks":
        ok = t.shape[-1] == 16
    if ok and "gate_up" in t.name:  # the axis its gate and up values alternate along
        ok = t.shape[2 if part == "" else 1] % 2 == 0
    if not ok:
        want = {"": "a float [E, rows, cols]", "_bias": "a float [E, n]", "_blocks": "U8 [E, rows, groups, 16]",
                "_scales": "U8 [E, rows, groups]"}[part]  # fmt: skip
        raise PlanError(f"{t.name} is {t.source.dtype}{list(t.shape)}; gpt-oss stores it as {want}")


def parameters(t: OutputTensor) -> int:
    """What ``get_total_parameters`` counts of ``t``: its values; a packed MXFP4 weight's (eight a
    word); nothing for scales or ``self_attn.sinks`` (a parameter of no leaf module, which it skips)."""
    if t.name.endswith(".sinks") or (t.dtype == "U8" and t.name.endswith(".scales")):
        return 0
    n = math.prod(t.shape)
    return n * 8 if t.dtype == "U32" and t.name.endswith(".weight") else n
