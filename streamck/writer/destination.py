"""Where a write's files go: a local folder or file, a ``--part`` of a folder, or stdout
(a bucket: streamck.writer.remote.Bucket).

Every destination is used in one order by streamck.writer.engine.write_plan:

1. ``check(plan, shards, extras)``: refuse the target (a source, an existing output
   without ``force``, a folder of a ``--part`` holding other files) before anything is written;
2. ``arrange(shards)``: the shards this run writes, laid out for the target (padded so
   that unchanged bytes share the source's blocks; a part's own share);
3. ``open()`` as a context: a temporary beside the target, or nothing; a clean exit
   commits (renames into place, completes uploads), an exception aborts (removes,
   aborts uploads) so that nothing half-written is left;
4. ``write(writer, shard)`` for each shard, from any of the writer's threads;
5. ``written(workers)`` once every shard is: synced, lossy casts refused, verified;
6. ``put(extras)``: the files after the shards (index, config, tokenizer);
7. ``files()``: what the output holds, once committed.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from streamck.errors import OutputError, UsageError
from streamck.fileio import fsync
from streamck.plan import Plan
from streamck.storage import UrlPath
from streamck.writer.atomic import atomic_output, check_target, refuse_source
from streamck.writer.clone import Sharing, line_up
from streamck.writer.layout import Shard
from streamck.writer.options import WriteOptions
from streamck.writer.parts import assign, check_directory
from streamck.writer.shardwriter import ShardWriter, Syncer, Workers
from streamck.writer.verify import verify_shard


class Destination:
    """The steps every destination has; the defaults write nothing anywhere."""

    single = True  # one file, not a folder
    sharing: Sharing | None = None  # set by arrange() where the target can share the source's blocks

    def __init__(self, out: Path | UrlPath | str, plan: Plan, options: WriteOptions):
        self.out, self.plan, self.options = out, plan, options
        self.sources = list(plan.source.files) if plan.source else []

    def check(self, shards: list[Shard], extras: list[str]) -> None:
        """Refuse the target before anything is written."""

    def arrange(self, shards: list[Shard]) -> list[Shard]:
        return shards

    @contextmanager
    def open(self) -> Iterator[None]:
        yield

    def write(self, writer: ShardWriter, shard: Shard) -> None:
        raise NotImplementedError

    def written(self, workers: Workers) -> None:
        refuse_overflow(workers.overflow, self.options.strict)

    def put(self, extras: dict[str, Path | bytes]) -> None:
        pass

    def files(self) -> list[Path | UrlPath]:
        raise NotImplementedError


class LocalTarget(Destination):
    """A file or a folder on this host: written under a temporary name beside it, fsynced,
    renamed into place (streamck.writer.atomic); unchanged tensors share the source's blocks
    where the filesystem can (streamck.writer.clone)."""

    def __init__(self, out: Path, plan: Plan, options: WriteOptions, single: bool):
        super().__init__(out, plan, options)
        self.single, self.names, self.extras, self.tmps = single, [], [], {}
        self.syncer = Syncer(options.drop_cache)

    def check(self, shards: list[Shard], extras: list[str]) -> None:
        self.names = [s.filename for s in shards]
        if self._split:  # a file output in numbered files beside it (gguf-split's): each checked as a file
            for name in self.names:
                check_target(self.out.parent / name, self.sources, is_dir=False, force=self.options.force)
            return
        check_target(self.out, self.sources, is_dir=not self.single, force=self.options.force)

    @property
    def _split(self) -> bool:
        return self.single and len(self.names) > 1

    def arrange(self, shards: list[Shard]) -> list[Shard]:
        return _shared(self, shards, self.out.parent)

    @contextmanager
    def open(self) -> Iterator[None]:
        try:
            with ExitStack() as stack:
                if self._split:  # each under a temporary name, all renamed into place at the end
                    for name in self.names:
                        tmp = atomic_output(self.out.parent / name, is_dir=False, force=self.options.force)
                        self.tmps[name] = stack.enter_context(tmp)
                else:
                    self.tmp = stack.enter_context(atomic_output(self.out, not self.single, self.options.force))
                yield
        finally:
            self.syncer.close()

    def _path(self, shard: Shard) -> Path:
        if self._split:
            return self.tmps[shard.filename]
        return self.tmp if self.single else self.tmp / shard.filename

    def write(self, writer: ShardWriter, shard: Shard) -> None:
        if "/" in shard.filename:  # a file in a folder of the output (a Megatron run's iter_0000000/)
            self._path(shard).parent.mkdir(parents=True, exist_ok=True)
        writer.write_file(shard, self._path(shard))
        self.syncer.submit(self._path(shard))

    def written(self, workers: Workers) -> None:
        self.syncer.wait()
        super().written(workers)
        if self.options.verify:
            workers.bar.phase("verifying")
            workers.map(lambda w, s: verify_shard(s, self._path(s), w.cpu_caster, workers.bar), self.shards)

    def put(self, extras: dict[str, Path | bytes]) -> None:
        if not self.single:
            for name, data in extras.items():
                (self.tmp / name).parent.mkdir(parents=True, exist_ok=True)
                put_file(data, self.tmp / name)
            self.extras = sorted(extras)

    def files(self) -> list[Path]:
        if self._split:
            return [self.out.parent / n for n in self.names]
        return [self.out] if self.single else [self.out / n for n in [*self.names, *self.extras]]


class PartTarget(Destination):
    """``--part K/N``: this run's share of a folder's shards, each renamed into the folder as
    it is done; then the side files, the same bytes from every part, and the index once every
    shard is there (streamck.writer.parts)."""

    single = False

    def check(self, shards: list[Shard], extras: list[str]) -> None:
        refuse_source(self.out, self.sources)
        check_directory(self.out, [s.filename for s in shards] + sorted(extras))

    def arrange(self, shards: list[Shard]) -> list[Shard]:
        # Parts may run on hosts whose filesystems clone differently, and pad differently: who
        # writes which shard is settled on the unpadded sizes, the same in every part.
        k, n = self.options.part
        owners = assign(shards, n)
        self.all = _shared(self, shards, self.out)
        self.mine = [s for s, owner in zip(self.all, owners, strict=True) if owner == k - 1]
        return self.mine

    def write(self, writer: ShardWriter, shard: Shard) -> None:
        with atomic_output(self.out / shard.filename, is_dir=False, force=True) as tmp:
            writer.write_file(shard, tmp)
            lossy = {t.name: writer.overflow[t.name] for t in shard.tensors if t.name in writer.overflow}
            refuse_overflow(lossy, self.options.strict)
            fsync(tmp)
            if self.options.verify:
                verify_shard(shard, tmp, writer.cpu_caster)

    def written(self, workers: Workers) -> None:
        pass  # each shard was checked as it was written

    def put(self, extras: dict[str, Path | bytes]) -> None:
        self.complete = all((self.out / s.filename).exists() for s in self.all)
        self.index = {n for n in extras if n.endswith(".index.json")}
        self.extras = [n for n in sorted(extras) if n not in self.index or self.complete]
        for name in self.extras:  # the index appears only with every shard: the last part to finish writes it
            data = extras[name]
            is_dir = not isinstance(data, bytes) and data.is_dir()
            with atomic_output(self.out / name, is_dir=is_dir, force=True) as tmp:
                put_file(data, tmp, replace=is_dir)

    def files(self) -> list[Path]:
        return [self.out / s.filename for s in self.mine] + [self.out / n for n in self.extras]


class Stdout(Destination):
    """``-o -``: one safetensors file on stdout, strictly in order (header first, no seeks)."""

    def check(self, shards: list[Shard], extras: list[str]) -> None:
        o = self.options
        if o.part is not None:
            raise UsageError("{part} writes its share of a directory output's files; -o - is one stream")
        if o.keep_shards:
            raise UsageError("{keep_shards} writes files beside their source's; -o - is one stream")
        if o.max_shard_size is not None or o.verify or self.plan.files:
            what = "{max_shard_size}" if o.max_shard_size is not None else "{verify}" if o.verify else None
            what = what or ", ".join(self.plan.files)
            raise OutputError(f"a stream holds one safetensors file and cannot be re-read: drop {what}", "-")
        fd = sys.stdout.fileno()
        if os.isatty(fd):
            raise OutputError("refusing to write a binary checkpoint to a terminal; redirect or pipe it", "-")
        out = os.fstat(fd)
        for src in self.sources:  # `rewrite SRC -o - >> SRC`: refused before a byte, as cat refuses
            if not isinstance(src, UrlPath) and os.path.samestat(out, os.stat(src)):
                raise OutputError(f"stdout is the source file {src}; refusing to write over it", "-")

    def write(self, writer: ShardWriter, shard: Shard) -> None:
        sys.stdout.flush()
        try:
            writer.write(shard, sys.stdout.fileno())
        except BrokenPipeError:
            raise  # the reader went away: the CLI says so in its own words
        except OSError as e:
            raise OutputError(f"write failed: {e.strerror or e}", e.filename or "stdout") from None

    def files(self) -> list[Path]:
        return [Path("-")]


def _shared(dest: Destination, shards: list[Shard], directory: Path) -> list[Shard]:
    """``shards`` padded so that unchanged tensors lie in step with their source, where the
    filesystem of ``directory`` can share blocks (XFS with reflink, btrfs…) and the format is
    safetensors; as they are elsewhere (the reference writer's layout)."""
    from streamck.gcpause import paused

    if shards and shards[0].format == "safetensors":
        dest.sharing = Sharing.probe(directory)
        with paused():
            shards = [line_up(s, dest.sharing, dest.options.header_align) for s in shards]
    dest.shards = shards
    return shards


def refuse_overflow(overflow: dict[str, int], strict: bool) -> None:
    """Under ``strict``, a cast that turned finite values into infinity is a PlanError."""
    from streamck.errors import PlanError, listing

    if strict and overflow:
        worst = sorted(overflow.items(), key=lambda kv: -kv[1])
        named = listing([f"{name} ({count})" for name, count in worst], 4)
        raise PlanError(f"{{strict}}: finite values became inf in the cast of {len(overflow)} tensors: {named}")


def put_file(data: Path | bytes, dest: Path, replace: bool = False) -> None:
    """Write bytes, copy a file, or copy a folder whole (a sentence-transformers module)
    to ``dest``, then fsync what was written."""
    if isinstance(data, bytes):
        dest.write_bytes(data)
    elif isinstance(data, UrlPath):  # a remote side file (a config, a tokenizer, or any size), or a folder of them
        if data.is_dir():
            dest.mkdir(exist_ok=replace)
            for entry in data.iterdir():
                put_file(entry, dest / entry.name, replace)
        else:
            with open(dest, "wb") as out:
                for piece in side_pieces(data):
                    out.write(piece)
    elif data.is_dir():
        shutil.copytree(data, dest, dirs_exist_ok=replace)
    else:
        shutil.copyfile(data, dest)
    for path in [dest, *dest.rglob("*")] if dest.is_dir() else [dest]:
        fsync(path)


SIDE_PIECE = 8 << 20  # a side file (a 256 MiB data.npz beside the weights) moves in pieces this size


def side_pieces(path: Path | UrlPath) -> Iterator[bytes]:
    """A side file's bytes in SIDE_PIECE pieces: never held whole, wherever it lies."""
    from streamck.storage import open_file

    with open_file(path) as f:
        while piece := f.read(SIDE_PIECE):
            yield piece
