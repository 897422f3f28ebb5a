"""A quantized source's weights in a GGUF file, as the reference writes them: FP8 as DeepSeek
publishes V3 (E4M3 ``weight`` beside a ``weight_scale_inv`` per 128x128 tile, ``quant_method:
fp8``), dequantized on the way.

The reference's ``ModelBase.dequant_model`` makes each such weight ``e4m3.float() * scale`` in
float32, and ``prepare_tensors`` converts that float32 tensor to the file's type. Here the weight
is dequantized by streamck's own transform (streamck.transforms.dequantize ``Fp8Dequant``, the same
float32 products) a band of rows at a time, and each band converted as the reference converts
float32: gguf-py's ``quants.quantize`` for F16 and BF16, streamck.transforms.q8_0 for Q8_0 (the
same bytes). An expert stack is dequantized one expert after another (Stack); MLA's kv_b_proj
(streamck.writer.formats.gguf.mla), whose k_b half is a transpose, is dequantized whole, one
tensor of float32, for each of its halves (Split).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import gguf
import numpy as np

from streamck.errors import OutputError, PlanError
from streamck.plan import OutputTensor, Plan
from streamck.source.header import TensorRef
from streamck.source.reader import Reader
from streamck.source.select import concat
from streamck.transforms.base import Computed, PieceStream, Transform
from streamck.transforms.q8_0 import Q8_VALUES, q8_0_shape, quantize
from streamck.writer.formats.gguf.experts import Stacker

F32 = "F32"


def dequantized(plan: Plan) -> Plan:
    """``plan`` with a quantized source's weights dequantized (into float32, as the reference
    computes them; the passes may have done so already, for ``--dtype``); the plan as it is for
    a source that is not FP8-quantized."""
    from streamck.plan.quant.dequant import SCALE_NAMES, dequantize_plan, quantized_kind

    if plan.source is None or quantized_kind(plan) != "fp8":  # others: as the family's rows take them (gpt-oss)
        return plan
    if any(t.transform is None and (t.source.dtype.startswith("F8") or t.name.rpartition(".")[2] in SCALE_NAMES)
           for t in plan.tensors):  # fmt: skip
        plan = dequantize_plan(plan, F32)
    return plan


def is_computed(t: OutputTensor) -> bool:
    """Whether ``t``'s bytes are a dequantization this module converts (its own Stack and Split
    included)."""
    from streamck.transforms.dequantize import Fp8Dequant

    return isinstance(t.transform, (Fp8Dequant, Stack, Split))


def output(t: OutputTensor, name: str, qtype: str, reordered: bool = False) -> OutputTensor:
    """The GGUF tensor ``name`` of the computed ``t``, in ``qtype`` (the type the reference
    gives it); a PlanError for a transform that is no dequantization (a LoRA merge …), or for
    rows the family reorders (``reordered``: Llama's q/k permutation, not done on computed rows)."""
    if not is_computed(t) or reordered:
        what = "its rows reordered" if is_computed(t) else "stored tensors only"
        raise PlanError(f"{t.name} is computed ({t.transform.label}): GGUF output reads {what}, yet")
    transform = Converted(t.transform, qtype, t.shape)
    if qtype == "Q8_0":
        return OutputTensor(name, t.source, "U8", transform, q8_0_shape(t.shape))
    return OutputTensor(name, t.source, qtype, transform, t.shape)


def _floats(inner: Transform, name: str, source: TensorRef, reader: Reader, space: dict) -> PieceStream:
    """``inner``'s output for ``source``, computed in float32, as a stream of bytes."""
    return PieceStream(inner.pieces(Computed(name, source, F32), reader, space))


def _read(stream: PieceStream, count: int, name: str) -> np.ndarray:
    """The next ``count`` float32 values of ``stream``; an OutputError where it ends first."""
    buf = bytearray(count * 4)
    if stream.readinto(memoryview(buf)) != len(buf):
        raise OutputError(f"{name}: its dequantized values ended early")
    return np.frombuffer(buf, np.float32)


def convert(values: np.ndarray, qtype: str) -> memoryview:
    """Float32 ``values`` (whole rows) as ``prepare_tensors`` converts them to ``qtype``."""
    if qtype == F32:
        return memoryview(values).cast("B")
    if qtype == "Q8_0":
        return memoryview(quantize(values, F32)).cast("B")
    return memoryview(np.ascontiguousarray(gguf.quants.quantize(values, gguf.GGMLQuantizationType[qtype]))).cast("B")


@dataclass(frozen=True, slots=True)
class Converted:
    """The output of ``inner`` (a dequantization) in GGML type ``ggml_type``, ``shape`` its
    logical shape: computed in float32, converted a band of whole rows at a time."""

    inner: Transform
    ggml_type: str
    shape: tuple[int, ...]
    engine: str = "torch"
    exact: bool = True

    @property
    def label(self) -> str:
        return f"{self.inner.label}, {self.ggml_type}"

    def inputs(self) -> tuple[TensorRef, ...]:
        return self.inner.inputs()

    def origin(self, source: TensorRef) -> TensorRef:
        return source

    def pieces(self, target, reader: Reader, space: dict) -> Iterator[memoryview]:
        cols = self.shape[-1]
        rows = math.prod(self.shape[:-1])
        step = max(1, Q8_VALUES // max(cols, 1))
        stream = _floats(self.inner, target.name, target.source, reader, space)
        for start in range(0, rows, step):
            yield convert(_read(stream, min(step, rows - start) * cols, target.name), self.ggml_type)


@dataclass(frozen=True, slots=True)
class Stack:
    """An expert stack [E, …] of dequantized experts: each expert's ``(source, transform)``
    computed in turn, so that one band of one expert is what is held."""

    experts: tuple[tuple[TensorRef, Transform], ...]
    engine: str = "torch"
    exact: bool = True

    @property
    def label(self) -> str:
        return f"{self.experts[0][1].label}, {len(self.experts)} experts stacked"

    def inputs(self) -> tuple[TensorRef, ...]:
        return tuple(dict.fromkeys(r for source, t in self.experts for r in (source, *t.inputs())))

    def origin(self, source: TensorRef) -> TensorRef:
        return source

    def pieces(self, target, reader: Reader, space: dict) -> Iterator[memoryview]:
        for source, transform in self.experts:
            yield from transform.pieces(Computed(target.name, source, target.dtype), reader, space)


@dataclass(frozen=True, slots=True)
class Split:
    """One half of MLA's dequantized kv_b_proj [H * (nope + v), C] (``source``, ``inner``):
    ``k_b`` [H, C, nope] (each head's first ``nope`` rows, transposed) or ``v_b`` [H, v, C]."""

    part: str
    heads: int
    nope: int
    v: int
    source: TensorRef
    inner: Transform
    engine: str = "torch"
    exact: bool = True

    @property
    def label(self) -> str:
        return f"{self.inner.label}, {self.part}"

    def inputs(self) -> tuple[TensorRef, ...]:
        return (self.source, *self.inner.inputs())

    def origin(self, source: TensorRef) -> TensorRef:
        return source

    def pieces(self, target, reader: Reader, space: dict) -> Iterator[memoryview]:
        rows, cols = self.source.shape
        stream = _floats(self.inner, target.name, self.source, reader, space)
        kv_b = _read(stream, rows * cols, target.name).reshape(self.heads, self.nope + self.v, cols)
        half = kv_b[:, : self.nope].transpose(0, 2, 1) if self.part == "k_b" else kv_b[:, self.nope :]
        yield memoryview(np.ascontiguousarray(half)).cast("B")  # float32: Converted converts it


def split(t: OutputTensor, names: tuple[str, str], heads: int, nope: int, v: int) -> tuple[OutputTensor, ...]:
    """A dequantized kv_b_proj ``t`` as its k_b and v_b halves, named ``names``, in float32."""
    if not is_computed(t):
        raise PlanError(f"{t.name} is computed ({t.transform.label}): GGUF output splits stored tensors only, yet")
    cols = t.shape[1]
    shapes = {"k_b": (heads, cols, nope), "v_b": (heads, v, cols)}
    return tuple(
        OutputTensor(name, t.source, F32, Split(part, heads, nope, v, t.source, t.transform), shapes[part])
        for part, name in zip(("k_b", "v_b"), names, strict=True)
    )


class DequantStacker(Stacker):
    """The reference's expert stacker (streamck.writer.formats.gguf.experts), for dequantized
    experts too: their stack is a Stack, computed in float32 one expert after another."""

    def _stack(self, layer: int, proj: str, experts: list[OutputTensor]) -> OutputTensor:
        if all(t.transform is None for t in experts):
            return super()._stack(layer, proj, experts)
        odd = next((t for t in experts if not is_computed(t)), None)
        if odd is not None:
            what = odd.transform.label if odd.transform is not None else "stored"
            raise PlanError(f"{odd.name} is {what} beside dequantized experts: GGUF output stacks them alike only")
        name = self.spec.stacked.format(bid=layer, proj=proj)
        try:
            ref = concat(name, [t.source for t in experts])
        except ValueError as e:
            raise PlanError(f"layer {layer}'s experts: {e}") from None
        stack = Stack(tuple((t.source, t.transform) for t in experts))
        return OutputTensor(name, ref, F32, stack, (self.count, *experts[0].shape))
