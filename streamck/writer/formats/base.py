"""What an output format is: how a plan lies in files, and the bytes around its tensors.

A format is one object with five steps, called in this order by streamck.writer.engine:

1. ``prepare(plan, options)``: the format's own plan pass (GGUF renames and stacks
   tensors); the plan of a format that needs none comes back as it is;
2. ``check(plan, options)``: refuse what it cannot write, before the target is touched;
3. ``layout(plan, filename, options)``: the files, each a Shard with the bytes that go
   up front (a header), computed before any byte is written;
4. ``write(shard, tensors, out)``: one file into the descriptor ``out``, its tensors'
   bytes moved by ``tensors`` (kernel copies, clones, casts, transforms: the writer's
   streamck.writer.shardwriter.ShardWriter), the format's own bytes between them;
5. ``extras(plan, shards)``: the files that come after the shards (an index, the plan's
   files: a config, a tokenizer).

Where the files go (a folder, a bucket, a stream, a part of a folder) is not the
format's business: that is a destination's (streamck.writer.destination).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol

from streamck.errors import OutputError
from streamck.plan import OutputTensor, Plan
from streamck.writer.layout import Shard

if TYPE_CHECKING:
    from streamck.writer.options import WriteOptions


class TensorBytes(Protocol):
    """What moves tensor bytes for a format (streamck.writer.shardwriter.ShardWriter)."""

    def copy(self, tensors: Sequence[OutputTensor], out: int, align: int = 1) -> None:
        """Write ``tensors``' bytes to ``out`` in order, each starting at a multiple of
        ``align`` (zeros between), the fastest way each allows."""
        ...

    def pieces(self, t: OutputTensor) -> Iterator[memoryview]:
        """``t``'s output bytes in bounded pieces, for a format that must see them (a CRC)."""
        ...

    def put(self, out: int, pieces: Iterable[bytes | memoryview]) -> None:
        """Write ``pieces`` (the format's own, or from ``pieces()``) to ``out``, the disk told
        to start on them as they come."""
        ...


class Format:
    """An output format; subclasses set the names and implement ``layout`` and ``write``.

    ``suffixes`` are the file names that ask for the format (``-o model.gguf``);
    ``single_name`` is a directory output's one file; ``streams`` says whether it can be
    written strictly in order (``-o -``); ``verifies`` whether ``--verify`` can re-read it;
    ``splits`` whether a file output takes ``max_shard_size`` (its files then lie beside it).
    """

    name: ClassVar[str]
    title: ClassVar[str]  # what a message calls one file of it: "a torch archive"
    suffixes: ClassVar[tuple[str, ...]] = ()
    single_name: ClassVar[str]
    streams: ClassVar[bool] = False
    verifies: ClassVar[bool] = True
    splits: ClassVar[bool] = False  # a file output may be split into numbered files beside it
    quantizes: ClassVar[tuple[str, ...]] = ()  # the --quantize schemes it writes itself (GGUF's Q8_0)
    owns_types: ClassVar[bool] = False  # it takes --dtype as its own outtype: the plan casts nothing
    own_schemes_only: ClassVar[bool] = False  # --quantize is one of ``quantizes``, never the plan's

    def prepare(self, plan: Plan, options: WriteOptions) -> Plan:
        """The plan as this format writes it (its own names, dtypes, stacks)."""
        return plan

    def check(self, plan: Plan, options: WriteOptions, target: Path | str) -> None:
        """Refuse what this format cannot write (OutputError or UsageError), before anything."""
        if plan.single_file and self.name != "safetensors":
            raise OutputError("this plan writes exactly one model.safetensors; drop {format}", target)

    def layout(self, plan: Plan, filename: str, options: WriteOptions) -> list[Shard]:
        """The files ``plan`` is written as: ``filename`` alone, or shards and what ties them."""
        raise NotImplementedError

    def write(self, shard: Shard, tensors: TensorBytes, out: int) -> None:
        """Write ``shard`` into ``out`` from its first byte to its last."""
        raise NotImplementedError

    def index(self, shards: list[Shard]) -> dict[str, bytes]:
        """The file that ties several shards together, by name (none for one file)."""
        return {}

    def extras(self, plan: Plan, shards: list[Shard]) -> dict[str, Path | bytes]:
        """Every file of a directory output but the shards: the index, the plan's files and
        its side files (the plan's own win over copies)."""
        return {**plan.side_files, **plan.files, **self.index(shards)}
