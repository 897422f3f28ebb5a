"""gpt-oss (``GptOssForCausalLM``) to GGUF as ``convert_hf_to_gguf.py``'s ``GptOssModel``
(``conversion/gpt_oss.py``) writes it, without reading a byte: what its ``generate_extra_tensors``,
``filter_tensors`` and ``modify_tensors`` do to the tensors the generic rules do not convert.

* ``self_attn.sinks`` is named as ``sinks.weight`` (``blk.N.attn_sinks.weight``, F32).
* The published layout's MXFP4 experts (``mlp.experts.{gate_up,down}_proj_blocks`` with their
  ``_scales``) become GGML MXFP4 tensors, repacked bit for bit (streamck.transforms.mxfp4_gguf),
  gate and up the fused tensor's even and odd rows; the reference writes them before every
  other tensor, in the order their scales are met.
* The bf16 layout's fused experts (``gate_up_proj`` [E, H, 2I], ``down_proj`` [E, I, H]) are
  transposed per expert, gate and up the even and odd rows of the transpose, in the file's type.
* ``gate_up_proj_bias`` [E, 2I] splits into the gate and up biases (even and odd columns);
  ``down_proj_bias`` is renamed. Biases are F32.

With an MXFP4 source (``quantization_config.quant_method`` ``mxfp4``) the file type key of a
float file is ``MOSTLY_MXFP4_MOE`` (``ModelBase.prepare_metadata``); its tensors keep the file's type.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gguf

from streamck.errors import PlanError
from streamck.plan import OutputTensor
from streamck.source import TensorRef
from streamck.source.select import Rows, concat, select
from streamck.transforms.mxfp4_gguf import GGML_BLOCK_BYTES, GROUP_BYTES, Mxfp4Repack, TransposedExperts

EXPERTS = ".mlp.experts."
SINKS = ".self_attn.sinks"
PACKED = ("_blocks", "_scales")
FLOAT_TYPES = ("F32", "F16", "BF16")
# the fused projection -> the Hugging Face-side names of what it becomes, in the reference's order
SPLITS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def file_type_key(ftype: gguf.LlamaFileType, hparams: dict[str, Any]) -> gguf.LlamaFileType:
    """``general.file_type`` as the reference writes it: ``MOSTLY_MXFP4_MOE`` for a float file of
    a model whose ``quantization_config`` says ``mxfp4``, else ``ftype``."""
    quant = hparams.get("quantization_config")
    floats = (gguf.LlamaFileType.ALL_F32, gguf.LlamaFileType.MOSTLY_F16, gguf.LlamaFileType.MOSTLY_BF16)
    if isinstance(quant, dict) and quant.get("quant_method") == "mxfp4" and ftype in floats:
        return gguf.LlamaFileType.MOSTLY_MXFP4_MOE
    return ftype


class Rewriter:
    """gpt-oss's own tensors, met in the reference's order: ``take`` each tensor, then
    ``finish``. ``names`` is the architecture's ``TensorNameMap``; ``qtype(name, shape)`` the
    type the generic rules give a tensor (``F32``, ``F16``, ``BF16`` or ``Q8_0``)."""

    def __init__(self, names: gguf.TensorNameMap, qtype: Callable[[str, tuple[int, ...]], str]):
        self.names, self.qtype = names, qtype
        self.front: list[OutputTensor] = []
        self.held: dict[str, OutputTensor] = {}

    def take(self, t: OutputTensor) -> list[OutputTensor] | None:
        """None for a tensor the generic rules convert; else the GGUF tensors it becomes here,
        none for MXFP4 blocks and scales (``finish`` hands those on)."""
        head, sep, proj = t.name.rpartition(EXPERTS)
        if not t.name.endswith(SINKS) and not sep:
            return None
        if t.transform is not None:
            raise PlanError(f"{t.name} is computed ({t.transform.label}): GGUF output reads stored tensors only, yet")
        if t.name.endswith(SINKS):
            return [self._float(t.name + ".weight", t.source)]
        base = head + EXPERTS
        if proj.endswith(PACKED):
            self._hold(t, base + proj)
            return []
        if proj == "down_proj_bias":
            return [self._float(base + "down_proj.bias", t.source)]
        if proj == "gate_up_proj_bias":
            return [self._float(f"{base}{p}.bias", _columns(t.source, k)) for k, p in enumerate(SPLITS["gate_up_proj"])]
        if proj in SPLITS:
            every = len(SPLITS[proj])
            return [self._transposed(f"{base}{p}.weight", t.source, every, k) for k, p in enumerate(SPLITS[proj])]
        known = ", ".join([*SPLITS, "gate_up_proj_bias", "down_proj_bias", "…_blocks", "…_scales"])
        raise PlanError(f"tensor {t.name}: GGUF output converts gpt-oss's experts as {known} only")

    def finish(self) -> list[OutputTensor]:
        """The MXFP4 tensors, in the order their pairs were completed; PlanError naming blocks
        without their scales (or scales without their blocks)."""
        if self.held:
            name = sorted(self.held)[0]
            stem, kind = name[: -len("_blocks")], name[-len("blocks") :]
            other = "scales" if kind == "blocks" else "blocks"
            raise PlanError(f"tensor {name}: MXFP4 {kind} without their {other} ({stem}_{other})")
        return self.front

    def _gguf_name(self, hf_name: str) -> str:
        name = self.names.get_name(key=hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise PlanError(f"tensor {hf_name} has no GGUF name for gpt-oss")
        return name

    def _float(self, hf_name: str, source: TensorRef) -> OutputTensor:
        """A sink or bias under its GGUF name, in the type the generic rules give it (F32)."""
        name = self._gguf_name(hf_name)
        qtype = self.qtype(name, source.shape)
        if source.dtype not in (*FLOAT_TYPES, "F64") or qtype not in FLOAT_TYPES:
            raise PlanError(f"{source.name} is {source.dtype}: GGUF output converts float tensors only")
        return OutputTensor(name, source, qtype)

    def _transposed(self, hf_name: str, source: TensorRef, every: int, offset: int) -> OutputTensor:
        """One of the bf16 layout's fused experts [E, A, B] as [E, B / every, A] (streamck.transforms.mxfp4_gguf)."""
        if len(source.shape) != 3 or source.shape[2] % every or source.dtype not in (*FLOAT_TYPES, "F64"):
            raise PlanError(
                f"tensor {source.name} is {source.dtype} {list(source.shape)}: gpt-oss's fused experts are float "
                f"[experts, rows, columns]{', the columns gate and up interleaved' if every > 1 else ''}"
            )
        experts, a, b = source.shape
        name = self._gguf_name(hf_name)
        shape = (experts, b // every, a)
        qtype = self.qtype(name, shape)
        byte_shape = gguf.quant_shape_to_byte_shape(shape, gguf.GGMLQuantizationType[qtype])
        return OutputTensor(name, source, "U8", TransposedExperts(shape, qtype, every, offset), tuple(byte_shape))

    def _hold(self, t: OutputTensor, name: str) -> None:
        """Keep MXFP4 blocks or scales until the other of the pair is met, then add its tensors to ``front``."""
        stem = name[: -len("_blocks")]
        self.held[name] = t
        pair = [self.held.get(stem + kind) for kind in PACKED]
        if None in pair:
            return
        blocks, scales = (self.held.pop(stem + kind).source for kind in PACKED)
        _check_pair(blocks, scales)
        proj = stem.rpartition(EXPERTS)[2]
        base = stem[: -len(proj)]
        every = len(SPLITS.get(proj, ()))
        if not every:
            raise PlanError(f"tensor {blocks.name}: GGUF output converts gpt-oss's MXFP4 {' and '.join(SPLITS)} only")
        for k, p in enumerate(SPLITS[proj]):
            self.front.append(self._mxfp4(self._gguf_name(f"{base}{p}.weight"), blocks, scales, every, k))

    def _mxfp4(self, name: str, blocks: TensorRef, scales: TensorRef, every: int, offset: int) -> OutputTensor:
        """Rows ``offset::every`` of each expert's blocks and scales as one GGML MXFP4 tensor."""
        experts, rows, groups, _ = blocks.shape
        if rows % every:
            raise PlanError(f"tensor {blocks.name} has {rows} rows: gate and up interleaved need an even count")
        if every > 1:
            blocks, scales = (_rows(r, every, offset) for r in (blocks, scales))
        rows //= every
        repack = Mxfp4Repack(scales, (experts, rows, groups * 32))
        return OutputTensor(name, blocks, "U8", repack, (experts, rows, groups * GGML_BLOCK_BYTES))


def _check_pair(blocks: TensorRef, scales: TensorRef) -> None:
    """PlanError where MXFP4 blocks and scales are not U8 [E, R, G, 16] and [E, R, G]."""
    shape = blocks.shape
    if blocks.dtype != "U8" or len(shape) != 4 or shape[3] != GROUP_BYTES:
        raise PlanError(f"tensor {blocks.name} is {blocks.dtype} {list(shape)}: MXFP4 blocks are U8 [E, R, G, 16]")
    if scales.dtype != "U8" or scales.shape != shape[:3]:
        raise PlanError(
            f"tensor {scales.name} is {scales.dtype} {list(scales.shape)}, its blocks {list(shape)}: "
            f"MXFP4 scales are U8 {list(shape[:3])}"
        )


def _rows(ref: TensorRef, every: int, offset: int) -> TensorRef:
    """Rows ``offset::every`` of each entry of ``ref``'s leading axis, over its own bytes."""
    experts, rows, *rest = ref.shape
    picked = [select(ref, Rows(offset, (rows // every,), (every,)), index=e) for e in range(experts)]
    return concat(ref.name, picked)._replace(shape=(experts, rows // every, *rest))


def _columns(ref: TensorRef, offset: int) -> TensorRef:
    """The even (``offset`` 0) or odd (1) columns of a [E, 2I] bias, over its own bytes."""
    if len(ref.shape) != 2 or ref.shape[1] % 2:
        raise PlanError(f"tensor {ref.name} is {list(ref.shape)}: gpt-oss's gate_up_proj_bias is [experts, 2 x rows]")
    return _rows(ref, 2, offset)
