"""Safetensors: one file, or numbered shards and ``model.safetensors.index.json``, as
``save_pretrained`` writes them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from streamck.errors import OutputError, UsageError
from streamck.fileio import write_all
from streamck.plan import Plan
from streamck.writer.formats.base import Format, TensorBytes
from streamck.writer.layout import INDEX_NAME, SINGLE_NAME, Shard, by_source_file, index_bytes, plan_shards

if TYPE_CHECKING:
    from streamck.writer.options import WriteOptions


class Safetensors(Format):
    name = "safetensors"
    title = "a safetensors file"
    suffixes = (".safetensors",)
    single_name = SINGLE_NAME
    streams = True

    def check(self, plan: Plan, options: WriteOptions, target: Path | str) -> None:
        if plan.single_file and options.max_shard_size is not None:
            raise OutputError("this plan writes exactly one model.safetensors; drop {max_shard_size}", target)
        if options.keep_shards and options.max_shard_size is not None:
            raise UsageError("{keep_shards} keeps the source's files; drop {max_shard_size}")
        if options.keep_shards:
            if plan.single_file:
                raise OutputError("this plan writes exactly one model.safetensors; drop {keep_shards}", target)
            if _is_file(target, self) and len(by_source_file(plan.tensors)) > 1:
                what = f"give a directory output, not {Path(target).name}"
                raise OutputError(f"{{keep_shards}} keeps several source files; {what}", target)

    def layout(self, plan: Plan, filename: str, options: WriteOptions) -> list[Shard]:
        return plan_shards(plan, filename, options.max_shard_size, options.header_align, self.name, options.keep_shards)

    def write(self, shard: Shard, tensors: TensorBytes, out: int) -> None:
        write_all(out, shard.header)
        tensors.copy(shard.tensors, out)

    def index(self, shards: list[Shard]) -> dict[str, bytes]:
        return {INDEX_NAME: index_bytes(shards)} if len(shards) > 1 else {}


def _is_file(target: Path | str, fmt: Format) -> bool:
    return str(target).endswith(fmt.suffixes)
