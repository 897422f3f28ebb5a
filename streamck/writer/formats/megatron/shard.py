"""The ``.distcp`` files of a Megatron output: Shards whose items are archives (dcp.Item)."""

from __future__ import annotations

from dataclasses import dataclass

from streamck.plan import OutputTensor
from streamck.writer.formats.megatron.dcp import Item
from streamck.writer.layout import Shard


@dataclass(frozen=True)
class DcpShard(Shard):
    """A ``.distcp`` file: its items in order; ``tensors`` the ones whose bytes fill them."""

    items: tuple[Item, ...] = ()

    @property
    def size(self) -> int:
        return sum(item.length for item in self.items)


def split(
    items: list[tuple[Item, OutputTensor | None]], pattern: str, max_size: int | None, fmt: str
) -> list[DcpShard]:
    """``items`` (each with the tensor that fills it, or None) in files named ``pattern.format(n=N)``,
    a new file started where one would pass ``max_size`` bytes (never an empty one)."""
    groups: list[list[tuple[Item, OutputTensor | None]]] = [[]]
    size = 0
    for item, tensor in items:
        if max_size is not None and groups[-1] and size + item.length > max_size:
            groups.append([])
            size = 0
        groups[-1].append((item, tensor))
        size += item.length
    return [_shard(pattern.format(n=n), group, fmt) for n, group in enumerate(groups)]


def _shard(filename: str, group: list[tuple[Item, OutputTensor | None]], fmt: str) -> DcpShard:
    tensors, items = [], []
    for item, tensor in group:
        if tensor is not None:
            item = item._replace(tensor=len(tensors))
            tensors.append(tensor)
        items.append(item)
    return DcpShard(filename, b"", tensors, fmt, items=tuple(items))
