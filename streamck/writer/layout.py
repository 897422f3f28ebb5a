"""Where every output byte goes, computed before any is written: shards, headers, index."""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from streamck.dtypes import RANK
from streamck.errors import UsageError
from streamck.plan import OutputTensor, Plan
from streamck.source import header

SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# The torch.save container: -o *.bin/*.pt/*.pth, or a directory with format="torch".
TORCH_SINGLE_NAME = "pytorch_model.bin"
TORCH_INDEX_NAME = "pytorch_model.bin.index.json"
FORMATS = ("safetensors", "torch")


@dataclass(frozen=True)
class Shard:
    """One output file: its name, its tensors in write order, the bytes that go before them
    (for safetensors its complete header, length prefix and padding included), the name of
    its format (streamck.writer.formats) and the alignment of its tensors' bytes; a ``torch``
    shard is a torch.save archive (streamck.writer.torchsave) and has no header of its own."""

    filename: str
    header: bytes
    tensors: list[OutputTensor]
    format: str = "safetensors"
    align: int = 1  # each tensor's bytes padded with zeros to a multiple of this (GGUF's 32)

    @property
    def entries(self) -> list[tuple[str, str, tuple[int, ...], int]]:
        return [(t.name, t.dtype, t.shape, t.nbytes) for t in self.tensors]

    @cached_property
    def size(self) -> int:
        """The file's bytes (for a torch archive, laid out once: it pickles every entry)."""
        if self.format == "torch":
            from streamck.writer.torchsave import archive_size

            return archive_size(self.filename, self.entries)
        return len(self.header) + sum(padded(t.nbytes, self.align) for t in self.tensors)


def padded(n: int, align: int) -> int:
    """``n`` rounded up to a multiple of ``align``."""
    return -(-n // align) * align


def write_order(tensors: list[OutputTensor]) -> list[OutputTensor]:
    """The reference writer's order: dtype (enum order) descending, then name."""
    return sorted(tensors, key=lambda t: (-RANK[t.dtype], t.name))


def header_bytes(tensors: list[OutputTensor], metadata: dict[str, str], align: int = header.ALIGN) -> bytes:
    """The complete header of a file holding ``tensors`` in that order (see encode_header)."""
    return header.encode_header(((t.name, t.dtype, t.shape, t.nbytes) for t in tensors), metadata, align)


def pad_header(header: bytes, data_start: int) -> bytes:
    """``header`` (as header_bytes returns it) padded with more spaces, which the format
    allows after the JSON, so that the data area starts at ``data_start``."""
    if data_start < len(header):
        raise ValueError(f"data_start {data_start} is inside the {len(header)}-byte header")
    raw = header[8:] + b" " * (data_start - len(header))
    return struct.pack("<Q", len(raw)) + raw


def by_source_file(tensors: list[OutputTensor]) -> list[list[OutputTensor]]:
    """``--keep-shards``: one group per source file holding some of ``tensors``, in the
    files' natural name order, each in its file's byte order, so that a rename keeps every
    tensor at its source offset. A tensor assembled from several files is a UsageError."""
    groups: dict[Path, list[OutputTensor]] = {}
    for t in tensors:
        paths = t.source.paths
        if len(paths) != 1:
            raise UsageError(
                f"{{keep_shards}} writes one file per source file, and {t.name} is assembled from "
                f"{len(paths)} files; drop {{keep_shards}}"
            )
        groups.setdefault(paths[0], []).append(t)
    files = sorted(groups, key=lambda p: _natural(str(p)))
    return [sorted(groups[p], key=lambda t: (t.source.start, t.name)) for p in files]


def _natural(name: str) -> list[object]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def split(tensors: list[OutputTensor], max_size: int) -> list[list[OutputTensor]]:
    """Group tensors in natural name order into shards of at most ``max_size`` data bytes;
    a tensor larger than that gets a shard of its own."""
    groups: list[list[OutputTensor]] = [[]]
    size = 0
    for t in sorted(tensors, key=lambda t: _natural(t.name)):
        if groups[-1] and size + t.nbytes > max_size:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    return groups


def plan_shards(
    plan: Plan,
    filename: str = SINGLE_NAME,
    max_size: int | None = None,
    align: int = 8,
    format: str = "safetensors",
    keep_shards: bool = False,
) -> list[Shard]:
    """Lay ``plan`` out as one file named ``filename``, or as numbered shards of at most
    ``max_size`` data bytes each (one shard keeps the single-file name), or with
    ``keep_shards`` one numbered shard per source file (by_source_file). Safetensors files
    order tensors as the reference writer does (kept shards as their source file does);
    torch archives by name, as a state dict reads."""
    if keep_shards:
        groups = by_source_file(plan.tensors)
    else:
        groups = split(plan.tensors, max_size) if max_size else [plan.tensors]
    n = len(groups)
    stem, suffix = ("pytorch_model", "bin") if format == "torch" else ("model", "safetensors")
    names = [filename] if n == 1 else [f"{stem}-{i:05d}-of-{n:05d}.{suffix}" for i in range(1, n + 1)]
    shards = []
    for name, group in zip(names, groups, strict=True):
        if format == "torch":
            shards.append(Shard(name, b"", sorted(group, key=lambda t: _natural(t.name)), "torch"))
        else:
            ordered = group if keep_shards else write_order(group)
            shards.append(Shard(name, header_bytes(ordered, plan.metadata, align), ordered))
    return shards


def index_bytes(shards: list[Shard]) -> bytes:
    """The shards' index (``model.safetensors.index.json`` or ``pytorch_model.bin.index.json``)
    as the Hugging Face tools write it."""
    weight_map = {t.name: s.filename for s in shards for t in s.tensors}
    index = {
        "metadata": {"total_size": sum(t.nbytes for s in shards for t in s.tensors)},
        "weight_map": dict(sorted(weight_map.items())),
    }
    return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
