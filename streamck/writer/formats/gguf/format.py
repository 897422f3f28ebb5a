"""GGUF, llama.cpp's file: the header (key-value pairs and tensor infos) up front, then each
tensor's bytes at a multiple of 32, as ``convert_hf_to_gguf.py`` writes it; with
``max_shard_size``, the split files gguf-split names (``OUT-00001-of-0000N.gguf``, ``split.*``
keys), split where the reference's ``--split-max-size`` splits them.

The header is gguf-py's own: a ``gguf.GGUFWriter`` (pack.Writer: its arrays packed in bulk, to
the same bytes) is given the tensor infos and the keys (streamck.writer.formats.gguf.meta) and
writes its header, key-values and tensor infos into memory; the tensors' bytes are then the
writer's (kernel copies, casts, Q8_0 bands).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING

import gguf
import numpy as np

from streamck.errors import PlanError
from streamck.fileio import write_all
from streamck.plan import OutputTensor, Plan
from streamck.writer.formats.base import Format, TensorBytes
from streamck.writer.formats.gguf import compat, meta, pack
from streamck.writer.formats.gguf.plan import Prepared, prepare
from streamck.writer.layout import Shard

if TYPE_CHECKING:
    from streamck.writer.options import WriteOptions


class GGUF(Format):
    """GGUF output. Its type is ``options.outtype`` (the reference's ``--outtype``: ``f32``,
    ``f16``, ``bf16``, ``q8_0``), else ``outtype``; ``auto`` is the planned dtype of the first
    matrix, so ``--dtype`` chooses among the float types (streamck.writer.formats.gguf.plan)."""

    name = "gguf"
    title = "a GGUF file"
    suffixes = (".gguf",)
    single_name = "model.gguf"
    verifies = False
    splits = True
    quantizes = ("Q8_0",)
    owns_types = True

    def __init__(self, outtype: str = "auto"):
        self.outtype = outtype
        self.prepared: Prepared | None = None

    def prepare(self, plan: Plan, options: WriteOptions) -> Plan:
        gguf_plan, self.prepared = prepare(plan, options.outtype or self.outtype)
        return gguf_plan

    def layout(self, plan: Plan, filename: str, options: WriteOptions) -> list[Shard]:
        if self.prepared is None:
            raise PlanError("GGUF: layout() before prepare()")
        return layout(plan.tensors, self.prepared, filename, options.max_shard_size or 0)

    def write(self, shard: Shard, tensors: TensorBytes, out: int) -> None:
        write_all(out, shard.header)
        tensors.copy(shard.tensors, out, align=shard.align)

    def extras(self, plan: Plan, shards: list[Shard]) -> dict[str, Path | bytes]:
        return {}  # a GGUF file holds its config and tokenizer


def ggml_type(t: OutputTensor) -> tuple[gguf.GGMLQuantizationType, tuple[int, ...]]:
    """The tensor's GGML type and logical shape (a Q8_0 tensor's bytes are U8 rows of blocks)."""
    kind = getattr(t.transform, "ggml_type", None)
    if kind is not None:
        return gguf.GGMLQuantizationType[kind], t.transform.shape
    return gguf.GGMLQuantizationType[t.dtype], t.shape


def layout(tensors: list[OutputTensor], prepared: Prepared, filename: str, max_size: int = 0) -> list[Shard]:
    """The files: ``filename`` alone, or gguf-split's numbered files of at most ``max_size``
    tensor bytes each, each Shard's header its complete front matter, padded to the alignment."""
    arch = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH[prepared.family.arch]]
    w = pack.Writer(path=None, arch=arch, split_max_size=max_size)  # gguf-py's, arrays packed in bulk
    by_name = {}
    for t in tensors:
        qtype, shape = ggml_type(t)
        w.add_tensor_info(t.name, shape, np.dtype(np.float32), t.nbytes, raw_dtype=qtype)
        by_name[t.name] = t
    with compat.paused_gc():  # the vocabulary: ~10^6 objects, no cycles
        meta.add_model_keys(w, prepared.family, prepared.hparams, prepared.model_dir, prepared.ftype)
    names = [Path(p).name for p in w.format_shard_names(Path(filename))]
    groups = [[by_name[n] for n in files] for files in w.tensors]
    compat.forget()  # the vocabulary is in the keys: tokenizer.json's parse is done with
    return [
        Shard(name, header, group, "gguf", w.data_alignment)
        for name, header, group in zip(names, headers(w), groups, strict=True)
    ]


def headers(w: gguf.GGUFWriter) -> list[bytes]:
    """Each file's bytes before its first tensor, as ``w`` writes them (magic, counts, key-values,
    tensor infos, zeros to the alignment), written into memory instead of files."""
    from gguf.gguf_writer import WriterState

    files = [io.BytesIO() for _ in w.tensors]
    w.fout, w.state = files, WriterState.EMPTY  # as open_output_file leaves it, with memory for files
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    out = [f.getvalue() for f in files]
    return [b + bytes(-len(b) % w.data_alignment) for b in out]
