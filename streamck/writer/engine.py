"""Write a compiled plan: headers first, then every tensor's bytes, chunk by chunk."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from streamck.errors import OutputError, StreamckError
from streamck.fileio import write_all
from streamck.plan import Plan
from streamck.source.strided import gather
from streamck.writer.atomic import atomic_output, check_target, signals_as_exceptions
from streamck.writer.copy import CHUNK, Copier
from streamck.writer.layout import INDEX_NAME, Shard, index_bytes, plan_shards
from streamck.writer.verify import verify_shard

_DROP_EVERY = 256 << 20


@dataclass
class WriteResult:
    """What a rewrite produced: the final paths, the bytes written, and per-tensor counts
    of finite values that a cast turned into infinity."""

    files: list[Path]
    total_size: int
    overflow: dict[str, int] = field(default_factory=dict)


def parse_size(text: str) -> int:
    """``5GB`` → 5·10⁹, ``500MiB`` → 500·2²⁰, ``1024`` → 1024 bytes."""
    units = {
        "": 1,
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
    }
    t = text.strip().upper()
    number = t.rstrip("KMGTIB")
    try:
        value = float(number) * units[t[len(number) :]]
    except (ValueError, KeyError):
        raise StreamckError(f"cannot read size {text!r} (examples: 5GB, 500MiB, 1048576)") from None
    if value < 1:
        raise StreamckError(f"size {text!r} must be at least one byte")
    return int(value)


def is_file_target(out: Path) -> bool:
    return out.name.endswith(".safetensors")


class _Progress:
    def __init__(self, total: int, enabled: bool):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                file=sys.stderr,
                dynamic_ncols=True,
                leave=False,
            )

    def __call__(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _Writer:
    """Streams shards into files; one per rewrite, holding the source fds and the movers."""

    def __init__(self, chunk: int, device: str | None, drop_cache: bool, progress: Callable[[int], None]):
        self.copier = Copier(chunk)
        self.caster = None
        self.chunk, self.device = chunk, device
        self.drop_cache = drop_cache
        self.progress = progress
        self.fds: dict[Path, int] = {}
        self.overflow: dict[str, int] = {}
        self._cpu_caster = None

    def _fd(self, path: Path) -> int:
        if path not in self.fds:
            self.fds[path] = os.open(path, os.O_RDONLY)
        return self.fds[path]

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)

    def write(self, shard: Shard, out: int) -> None:
        write_all(out, shard.header)
        since_drop = 0
        for t in shard.tensors:
            src = t.source
            fd = self._fd(src.path)
            if t.is_cast:
                if self.caster is None:
                    from streamck.writer.cast import CAST_CHUNK, Caster

                    self.caster = Caster(min(self.chunk, CAST_CHUNK), self.device or "cpu")
                n = self.caster.cast(fd, src.start, src.numel, src.dtype, t.dtype, out, str(src.path), self.progress)
                if n:
                    self.overflow[t.name] = n
            elif src.strides is not None:  # a non-contiguous torch view: gathered, not copied
                for block in gather(src, self.chunk):
                    write_all(out, block)
                    self.progress(len(block))
            else:
                self.copier.copy(fd, src.start, src.nbytes, out, str(src.path), self.progress)
            if self.drop_cache:
                os.posix_fadvise(fd, src.start, src.nbytes, os.POSIX_FADV_DONTNEED)
                since_drop += t.nbytes
                if since_drop >= _DROP_EVERY:
                    os.fdatasync(out)  # only clean pages can be dropped
                    os.posix_fadvise(out, 0, 0, os.POSIX_FADV_DONTNEED)
                    since_drop = 0

    def cpu_caster(self):
        from streamck.writer.cast import CAST_CHUNK, Caster

        if self._cpu_caster is None:
            self._cpu_caster = Caster(min(self.chunk, CAST_CHUNK), "cpu")
        return self._cpu_caster

    def write_file(self, shard: Shard, path: Path) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            self.write(shard, fd)
            os.fsync(fd)
            if self.drop_cache:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def rewrite(
    plan: Plan,
    out: str | os.PathLike,
    *,
    max_shard_size: int | None = None,
    header_align: int = 8,
    force: bool = False,
    drop_cache: bool = False,
    device: str | None = None,
    verify: bool = False,
    chunk: int = CHUNK,
    progress: bool = False,
) -> WriteResult:
    """Write ``plan`` to ``out``: a ``*.safetensors`` path is one file; any other path is a
    directory holding ``model.safetensors`` (or numbered shards and an index when
    ``max_shard_size`` splits it) and the plan's extra files.

    With ``verify``, every written tensor is re-read and checked against its source
    (or a fresh CPU cast of it) before the output is kept.

    Memory stays near ``chunk`` bytes whatever the tensor sizes. The output appears
    under its final name only when complete and fsynced; on any error or signal
    nothing is left there. Raises StreamckError (OutputError for refused targets).
    """
    if header_align < 8 or header_align % 8:
        raise StreamckError(f"--header-align {header_align}: must be a positive multiple of 8")
    if os.fspath(out) == "-":
        return _to_stdout(plan, header_align, drop_cache, device, verify, chunk, max_shard_size, progress)
    out = Path(out)
    single = is_file_target(out)
    if plan.single_file and max_shard_size is not None:
        raise OutputError("this plan writes exactly one model.safetensors; drop --max-shard-size", out)
    if single and max_shard_size is not None:
        raise OutputError("--max-shard-size needs a directory output, not a .safetensors file", out)
    if single and plan.files:
        raise OutputError(f"this plan also writes {', '.join(plan.files)}; give a directory output", out)
    sources = list(plan.source.files) if plan.source else []
    check_target(out, sources, is_dir=not single, force=force)
    shards = plan_shards(plan, out.name if single else "model.safetensors", max_shard_size, header_align)
    bar = _Progress(plan.total_size, progress)
    writer = _Writer(chunk, device, drop_cache, bar)
    with ExitStack() as stack:
        stack.enter_context(signals_as_exceptions())
        stack.callback(bar.close)
        stack.callback(writer.close)
        tmp = stack.enter_context(atomic_output(out, is_dir=not single, force=force))
        try:
            paths = [tmp] if single else [tmp / s.filename for s in shards]
            for shard, path in zip(shards, paths, strict=True):
                writer.write_file(shard, path)
            if verify:
                for shard, path in zip(shards, paths, strict=True):
                    verify_shard(shard, path, writer.cpu_caster)
            if not single:
                extras = dict(plan.files)
                if len(shards) > 1:
                    extras[INDEX_NAME] = index_bytes(shards)
                for name, data in extras.items():
                    (tmp / name).write_bytes(data)
                for name, path in plan.side_files.items():
                    if name not in extras:
                        shutil.copyfile(path, tmp / name)
                for name in {*extras, *plan.side_files}:
                    fd = os.open(tmp / name, os.O_RDONLY)
                    os.fsync(fd)
                    os.close(fd)
        except OSError as e:
            where = e.filename or out
            raise OutputError(f"write failed: {e.strerror or e}", where) from None
        if plan.source is not None:
            plan.source.check_unchanged()
    files = [out] if single else [out / s.filename for s in shards] + [out / n for n in {*plan.files, *plan.side_files}]
    if len(shards) > 1:
        files.append(out / INDEX_NAME)
    return WriteResult(files, plan.total_size, writer.overflow)


def _to_stdout(plan: Plan, header_align: int, drop_cache: bool, device: str | None, verify: bool, chunk: int,
               max_shard_size: int | None, progress: bool) -> WriteResult:  # fmt: skip
    """One safetensors file on stdout, strictly sequential (header first, no seeks)."""
    refused = [what for what, bad in (("--max-shard-size", max_shard_size), ("--verify", verify),
                                      (", ".join(plan.files), plan.files)) if bad]  # fmt: skip
    if refused:
        raise OutputError(f"cannot go to a stream: {refused[0]}", "-")
    fd = sys.stdout.fileno()
    if os.isatty(fd):
        raise OutputError("refusing to write a binary checkpoint to a terminal; redirect or pipe it", "-")
    sys.stdout.flush()
    (shard,) = plan_shards(plan, "-", None, header_align)
    bar = _Progress(plan.total_size, progress)
    writer = _Writer(chunk, device, drop_cache=False, progress=bar)
    try:
        with signals_as_exceptions():
            writer.write(shard, fd)
    finally:
        writer.close()
        bar.close()
    if plan.source is not None:
        plan.source.check_unchanged()
    return WriteResult([Path("-")], plan.total_size, writer.overflow)
