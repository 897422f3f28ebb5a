"""torch.save archives: ``pytorch_model.bin`` or numbered shards and their index, as
``save_pretrained(safe_serialization=False)`` writes them (streamck.writer.torchsave)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from streamck.errors import UsageError
from streamck.plan import Plan
from streamck.source.torchzip.archive import TORCH_SUFFIXES
from streamck.writer.formats.base import Format, TensorBytes
from streamck.writer.layout import TORCH_INDEX_NAME, TORCH_SINGLE_NAME, Shard, index_bytes, plan_shards
from streamck.writer.torchsave import refuse_unsaveable, stream_archive

if TYPE_CHECKING:
    from streamck.writer.options import WriteOptions


class TorchArchive(Format):
    name = "torch"
    title = "a torch archive"
    suffixes = TORCH_SUFFIXES
    single_name = TORCH_SINGLE_NAME

    def check(self, plan: Plan, options: WriteOptions, target: Path | str) -> None:
        super().check(plan, options, target)
        if options.keep_shards:
            raise UsageError("{keep_shards} writes safetensors files (a torch archive shares no bytes with its source)")
        refuse_unsaveable(plan.tensors)

    def layout(self, plan: Plan, filename: str, options: WriteOptions) -> list[Shard]:
        return plan_shards(plan, filename, options.max_shard_size, options.header_align, self.name)

    def write(self, shard: Shard, tensors: TensorBytes, out: int) -> None:
        # Every byte passes through Python for its CRC-32: even unchanged tensors are read, not copied kernel-side.
        tensors.put(out, stream_archive(shard.filename, shard.entries, (tensors.pieces(t) for t in shard.tensors)))

    def index(self, shards: list[Shard]) -> dict[str, bytes]:
        return {TORCH_INDEX_NAME: index_bytes(shards)} if len(shards) > 1 else {}
