"""How a plan is written: one frozen object, checked where it is made.

``WriteOptions`` is to the writer what ``SourceSpec`` is to the source: every option the
CLI's output group sets, with the library's names and types. Its errors name the field
(``max_shard_size``); the CLI words them as flags (streamck.cli_args.FLAGS).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from streamck.errors import UsageError
from streamck.source.reader import CHUNK
from streamck.units import parse_size

PROGRESS = ("auto", "bar", "log", "none")


@dataclass(frozen=True)
class WriteOptions:
    """What the writer does with a plan.

    ``format`` is the output format (``"safetensors"``, ``"torch"``, ``"gguf"``; by default
    what the output's name asks for, else safetensors). ``outtype`` is the type a format that
    chooses its tensors' types itself writes them in (GGUF's ``--outtype``: ``f32``, ``f16``,
    ``bf16``, ``q8_0``; ``--dtype`` and ``--quantize Q8_0`` set it for a GGUF output).
    ``max_shard_size`` (bytes, or a size such as ``"5GB"``) splits a directory output into
    numbered shards and an index (a GGUF file into gguf-split's numbered files);
    ``keep_shards`` writes one file per source file instead. ``header_align`` aligns the data
    of safetensors files. ``force`` replaces an earlier output. ``verify`` re-reads every
    written tensor against its source before the output is kept. ``strict`` makes a lossy cast
    (finite values become infinity) an error. ``device`` casts and computes on ``"cuda"`` (or
    ``"cuda:N"``). ``jobs`` writes that many files at once. ``part`` (``(K, N)`` or ``"K/N"``)
    writes only part K of N of a directory output's files (streamck.writer.parts).
    ``drop_cache`` keeps the page cache from filling. Two are one format's own (None: its
    default; set for another format: refused): ``make_vocab_size_divisible_by`` pads a megatron
    vocabulary to a multiple of it (Megatron-LM's flag, 128), ``group_size`` is the values per
    scale of an MLX ``quantize`` scheme (mlx_lm.convert's ``--q-group-size``, 64). ``progress``
    is ``"auto"``, ``"bar"``, ``"log"`` or ``"none"`` (True and False: bar and none), or a
    streamck.writer.progress reporter. ``chunk`` bounds the bytes held per job.
    """

    format: str | None = None
    outtype: str | None = None
    max_shard_size: int | None = None
    keep_shards: bool = False
    header_align: int = 8
    force: bool = False
    verify: bool = False
    strict: bool = False
    device: str | None = None
    jobs: int = 1
    part: tuple[int, int] | None = None
    drop_cache: bool = False
    make_vocab_size_divisible_by: int | None = None
    group_size: int | None = None
    progress: Any = False
    chunk: int = CHUNK

    def __post_init__(self) -> None:
        if isinstance(self.max_shard_size, str):
            object.__setattr__(self, "max_shard_size", parse_size(self.max_shard_size, "{max_shard_size}"))
        if isinstance(self.part, str):
            from streamck.writer.parts import parse_part

            object.__setattr__(self, "part", parse_part(self.part))
        _check(self)

    @classmethod
    def of(cls, options: WriteOptions | None = None, **changes: Any) -> WriteOptions:
        """``options`` (or the defaults) with ``changes`` (this class's fields) over them.
        Raises UsageError for a field it does not know."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise UsageError(f"unknown write option(s): {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        return replace(options or cls(), **changes)


def _check(o: WriteOptions) -> None:
    """Values no write can take, refused before anything is read. The marks (``{jobs}``) say
    the option as the caller spells it (streamck.errors.OPTIONS)."""
    if o.max_shard_size is not None and o.max_shard_size < 1:
        raise UsageError(f"{{max_shard_size}} {o.max_shard_size}: must be at least one byte")
    if o.header_align < 8 or o.header_align % 8:
        raise UsageError(f"{{header_align}} {o.header_align}: must be a positive multiple of 8")
    if o.jobs < 1:
        raise UsageError(f"{{jobs}} {o.jobs}: must be at least 1")
    if o.make_vocab_size_divisible_by is not None and o.make_vocab_size_divisible_by < 1:
        what = "must be at least 1 (Megatron pads the vocabulary to a multiple of it)"
        raise UsageError(f"{{make_vocab_size_divisible_by}} {o.make_vocab_size_divisible_by}: {what}")
    if o.group_size is not None and o.group_size < 1:
        raise UsageError(f"{{group_size}} {o.group_size}: must be at least 1")
    if o.chunk < 1:
        raise UsageError(f"chunk {o.chunk}: must be at least one byte")
    if o.jobs > 1 and o.device not in (None, "cpu"):
        raise UsageError(f"{{jobs}} {o.jobs} with {{device}} {o.device}: one device pipeline runs at a time")
    if isinstance(o.progress, str) and o.progress not in PROGRESS:
        raise UsageError(f"{{progress}} {o.progress}: one of {', '.join(PROGRESS)}")
