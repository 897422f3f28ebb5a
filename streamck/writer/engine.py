"""Write a compiled plan: headers first, then every tensor's bytes, chunk by chunk."""

from __future__ import annotations

import os
import re
import shutil
import sys
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from streamck.errors import OutputError, PlanError, UsageError, listing
from streamck.gcpause import paused
from streamck.plan import Plan
from streamck.source.layout import joins_shards
from streamck.source.reader import CHUNK
from streamck.source.torchzip.archive import TORCH_SUFFIXES
from streamck.storage import UrlPath, is_url, location
from streamck.writer.atomic import atomic_output, check_target, refuse_source
from streamck.writer.clone import Sharing, line_up
from streamck.writer.layout import (
    FORMATS,
    INDEX_NAME,
    SINGLE_NAME,
    TORCH_INDEX_NAME,
    TORCH_SINGLE_NAME,
    Shard,
    by_source_file,
    index_bytes,
    plan_shards,
)
from streamck.writer.parts import assign, check_directory
from streamck.writer.progress import Silent, reporter
from streamck.writer.remote import check_remote_target, write_remote
from streamck.writer.shardwriter import ShardWriter, Syncer, Workers
from streamck.writer.torchsave import refuse_unsaveable
from streamck.writer.verify import verify_shard


@dataclass
class WriteResult:
    """What a rewrite produced: the final paths, the tensor bytes written (of which
    ``shared`` share the source's blocks rather than copy them, streamck.writer.clone), and
    per-tensor counts of finite values that a cast turned into infinity."""

    files: list[Path]
    total_size: int
    overflow: dict[str, int] = field(default_factory=dict)
    shared: int = 0
    tensors: int = 0  # written by this run: a --part's share, else the plan's every tensor

    @property
    def copied(self) -> int:
        """Tensor bytes written (copied or cast) rather than shared."""
        return self.total_size - self.shared


_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?)(b?)", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``5GB`` (or ``5G``, ``5gb``) → 5·10⁹, ``500MiB`` → 500·2²⁰, ``1024`` → 1024 bytes."""
    m = _SIZE.fullmatch(text.strip())
    if m is None or (m.group(3) and not m.group(2)):
        raise UsageError(f"cannot read size {text!r} (examples: 5GB, 500MiB, 1048576)")
    number, prefix, binary = m.group(1), m.group(2).upper(), bool(m.group(3))
    power = "KMGT".index(prefix) + 1 if prefix else 0
    value = int(float(number) * ((1024 if binary else 1000) ** power))
    if value < 1:
        raise UsageError(f"size {text!r} must be at least one byte")
    return value


def file_format(out: Path) -> str | None:
    """The format a file target's name asks for, or None for a directory target."""
    if out.name.endswith(".safetensors"):
        return "safetensors"
    if out.suffix in TORCH_SUFFIXES:
        return "torch"
    return None


def write_plan(
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
    progress: bool | str | Silent = False,
    format: str | None = None,
    jobs: int = 1,
    part: tuple[int, int] | None = None,
    keep_shards: bool = False,
    strict: bool = False,
) -> WriteResult:
    """Write ``plan`` to ``out``: a ``*.safetensors`` path is one file, a ``*.bin``/``.pt``/
    ``.pth`` path one torch.save archive; any other path is a directory holding
    ``model.safetensors`` (or ``pytorch_model.bin`` with ``format="torch"``), or numbered
    shards and an index when ``max_shard_size`` splits it, and the plan's extra files.

    With ``verify``, every written tensor is re-read and checked against its source
    (or a fresh CPU cast of it) before the output is kept. ``jobs`` writes that many
    shards at once (threads; the bytes are the same as with one). ``part=(K, N)`` writes
    only part K of N of a directory output's shards, see streamck.writer.parts.
    ``keep_shards`` writes one shard per source file, its tensors in the source's order.
    ``strict`` makes a lossy cast (finite values turned into infinity) an error: the output
    (or the part's shard) is not kept; on a stream (``out="-"``) the error comes at its end.
    ``progress`` shows the write's progress on stderr: ``"bar"`` (or True), ``"log"`` (a line
    every 10 s, for batch jobs), ``"auto"`` (a bar on a terminal, else log lines), or
    ``"none"`` (or False), or a reporter of streamck.writer.progress.

    Where the output's filesystem can share blocks (XFS with reflink, btrfs…), headers are
    padded so that unchanged tensors lie in step with their source, and their bytes are
    shared rather than copied (streamck.writer.clone); elsewhere the layout is the
    reference writer's.

    Memory stays near ``chunk`` bytes whatever the tensor sizes. The output appears
    under its final name only when complete and fsynced; on any error or signal
    nothing is left there. Raises StreamckError (OutputError for refused targets).
    """
    if header_align < 8 or header_align % 8:
        raise UsageError(f"--header-align {header_align}: must be a positive multiple of 8")
    if jobs < 1:
        raise UsageError(f"--jobs {jobs}: must be at least 1")
    if chunk < 1:
        raise UsageError(f"chunk {chunk}: must be at least one byte")
    if jobs > 1 and device not in (None, "cpu"):
        raise UsageError(f"--jobs {jobs} with --device {device}: one device pipeline runs at a time")
    if os.fspath(out) == "-":
        if format not in (None, "safetensors"):
            raise UsageError("-o - streams one safetensors file; write a torch archive to a path")
        if part is not None:
            raise UsageError("--part writes its share of a directory output's files; -o - is one stream")
        if keep_shards:
            raise UsageError("--keep-shards writes files beside their source's; -o - is one stream")
        result = _to_stdout(plan, header_align, device, verify, chunk, max_shard_size, progress)
        _refuse_overflow(result.overflow, strict)
        return result
    out = location(out) if is_url(out) else _target(out)
    named = file_format(out)
    single = named is not None
    if format is not None and format not in FORMATS:
        raise UsageError(f"--format {format}: one of {', '.join(FORMATS)}")
    if named is not None and format not in (None, named):
        raise UsageError(f"--format {format} disagrees with the output's name {out.name}")
    format = named or format or "safetensors"
    if format == "torch":
        refuse_unsaveable(plan.tensors)
    if plan.single_file and format != "safetensors":
        raise OutputError("this plan writes exactly one model.safetensors; drop --format", out)
    if plan.single_file and max_shard_size is not None:
        raise OutputError("this plan writes exactly one model.safetensors; drop --max-shard-size", out)
    if single and max_shard_size is not None:
        raise OutputError(f"--max-shard-size needs a directory output, not a {out.suffix} file", out)
    if single and plan.files:
        raise OutputError(f"this plan also writes {', '.join(plan.files)}; give a directory output", out)
    if single and part is not None:
        raise UsageError(f"--part splits a directory output's files; {out.name} is one file")
    if keep_shards:
        _check_keep_shards(plan, out, single, format, max_shard_size)
    sources = list(plan.source.files) if plan.source else []
    if single and plan.source is not None and not isinstance(out, UrlPath):
        _refuse_joining(out, plan)
    default = TORCH_SINGLE_NAME if format == "torch" else SINGLE_NAME
    with paused():  # headers and layouts: a few objects per tensor (see streamck.gcpause)
        shards = plan_shards(plan, out.name if single else default, max_shard_size, header_align, format, keep_shards)
    if isinstance(out, UrlPath):
        _refuse_for_urls(verify, part)
        check_remote_target(out, sources, not single, force, [*plan.files, *plan.side_files])
        return _write_url(plan, out, shards, single, force, strict, progress, jobs, chunk, device)
    if part is None:
        check_target(out, sources, is_dir=not single, force=force, writes=[*plan.files, *plan.side_files])
    else:
        refuse_source(out, sources)
        check_directory(out, [s.filename for s in shards] + sorted(_extras(plan, shards)))
    # Parts may run on hosts whose filesystems clone differently, and pad differently: who
    # writes which shard is settled on the unpadded sizes, the same in every part.
    owners = assign(shards, part[1]) if part is not None else []
    sharing = Sharing.probe(out if part is not None else out.parent) if format == "safetensors" else None
    if sharing is not None:
        with paused():
            shards = [line_up(s, sharing, header_align) for s in shards]
    bar = reporter(plan.total_size, progress, kinds=work_kinds(plan), verify=verify)
    workers = Workers(jobs, chunk, device, drop_cache, bar, sharing)
    if _casts(plan, device):
        _caster(workers.first)  # a missing torch or CUDA device is an error before any file exists
    syncer = Syncer(drop_cache)
    with ExitStack() as stack:
        stack.callback(bar.close)
        stack.callback(workers.close)
        stack.callback(syncer.close)
        try:
            if part is not None:
                files, size, count = _write_part(plan, out, shards, owners, part[0], workers, verify, strict)
                return WriteResult(files, size, workers.overflow, workers.shared, count)
            tmp = stack.enter_context(atomic_output(out, is_dir=not single, force=force))
            paths = [tmp] if single else [tmp / s.filename for s in shards]

            def write(writer: ShardWriter, i: int) -> None:
                writer.write_file(shards[i], paths[i])
                syncer.submit(paths[i])

            workers.map(write, list(range(len(shards))))
            syncer.wait()
            _refuse_overflow(workers.overflow, strict)
            if verify:
                bar.phase("verifying")
                workers.map(lambda w, i: verify_shard(shards[i], paths[i], w.cpu_caster, bar), list(range(len(shards))))
            extras = [] if single else _write_extras(plan, shards, tmp)
        except OSError as e:
            where = e.filename or out
            raise OutputError(f"write failed: {e.strerror or e}", where) from None
        if plan.source is not None:
            plan.source.check_unchanged()
    files = [out] if single else [out / s.filename for s in shards] + [out / n for n in extras]
    return WriteResult(files, plan.total_size, workers.overflow, workers.shared, len(plan.tensors))


def _write_part(
    plan: Plan,
    out: Path,
    shards: list[Shard],
    owners: list[int],
    k: int,
    workers: Workers,
    verify: bool,
    strict: bool = False,
) -> tuple[list[Path], int, int]:
    """Part ``k`` (1-based): the shards ``owners`` gives it (each shard's 0-based part), each
    written, fsynced (and verified) under a temporary name and renamed into ``out``; then
    the side files, the same bytes from every part,
    and the index once every shard is there (whichever part finishes last writes it;
    downstream jobs may wait for it). Returns the paths written, their tensor bytes and count."""
    mine = [s for s, owner in zip(shards, owners, strict=True) if owner == k - 1]

    def write(writer: ShardWriter, shard: Shard) -> None:
        with atomic_output(out / shard.filename, is_dir=False, force=True) as tmp:
            writer.write_file(shard, tmp)
            lossy = {t.name: writer.overflow[t.name] for t in shard.tensors if t.name in writer.overflow}
            _refuse_overflow(lossy, strict)
            _fsync(tmp)
            if verify:
                verify_shard(shard, tmp, writer.cpu_caster)

    workers.map(write, mine)
    extras = _extras(plan, shards)
    index = {TORCH_INDEX_NAME, INDEX_NAME} & set(extras)
    complete = all((out / s.filename).exists() for s in shards)
    for name, data in extras.items():
        if name in index and not complete:
            continue  # the index appears only with every shard: the last part to finish writes it
        is_dir = not isinstance(data, bytes) and data.is_dir()
        with atomic_output(out / name, is_dir=is_dir, force=True) as tmp:
            _put(data, tmp, replace=is_dir)
    if plan.source is not None:
        plan.source.check_unchanged()
    written = [out / s.filename for s in mine] + [out / n for n in sorted(extras) if n not in index or complete]
    return written, sum(t.nbytes for s in mine for t in s.tensors), sum(len(s.tensors) for s in mine)


def _refuse_for_urls(verify: bool, part: tuple[int, int] | None) -> None:
    """What a URL output does not do, refused before anything is sent."""
    if verify:
        raise UsageError("--verify re-reads the output from disk: not for URL outputs yet")
    if part is not None:
        raise UsageError("--part writes into a folder shared by its runs: not to URLs yet")


def _write_url(
    plan: Plan, out: UrlPath, shards: list[Shard], single: bool, force: bool, strict: bool,
    progress: bool | str | Silent, jobs: int, chunk: int, device: str | None,
) -> WriteResult:  # fmt: skip
    """``plan`` into the bucket at ``out`` (streamck.writer.remote): nothing there until all is."""
    bar = reporter(plan.total_size, progress, kinds=work_kinds(plan))
    workers = Workers(jobs, chunk, device, False, bar)
    if _casts(plan, device):
        _caster(workers.first)

    def before_commit() -> None:
        _refuse_overflow(workers.overflow, strict)
        if plan.source is not None:
            plan.source.check_unchanged()

    try:
        files = write_remote(out, shards, _extras(plan, shards), workers, single, force, before_commit)
    finally:
        workers.close()
        bar.close()
    return WriteResult(files, plan.total_size, workers.overflow, 0, len(plan.tensors))


def work_kinds(plan: Plan) -> dict[str, tuple[str, int]]:
    """Each output tensor's kind of work (``copy``, ``cast``, or its transform's class) and
    bytes, for the progress log's time left: the kinds go at very different rates."""
    return {
        t.name: (type(t.transform).__name__ if t.transform is not None else "cast" if t.is_cast else "copy", t.nbytes)
        for t in plan.tensors
    }


def _refuse_overflow(overflow: dict[str, int], strict: bool) -> None:
    """Under ``strict``, a cast that turned finite values into infinity is a PlanError."""
    if strict and overflow:
        worst = sorted(overflow.items(), key=lambda kv: -kv[1])
        named = listing([f"{name} ({count})" for name, count in worst], 4)
        raise PlanError(f"--strict: finite values became inf in the cast of {len(overflow)} tensors: {named}")


def _check_keep_shards(plan: Plan, out: Path, single: bool, format: str, max_shard_size: int | None) -> None:
    """``--keep-shards`` lays safetensors files out as the source's: refuse what it cannot."""
    if max_shard_size is not None:
        raise UsageError("--keep-shards keeps the source's files; drop --max-shard-size")
    if format != "safetensors":
        raise UsageError("--keep-shards writes safetensors files (a torch archive shares no bytes with its source)")
    if plan.single_file:
        raise OutputError("this plan writes exactly one model.safetensors; drop --keep-shards", out)
    if single and len(by_source_file(plan.tensors)) > 1:
        raise OutputError(f"--keep-shards keeps several source files; give a directory output, not {out.name}", out)


def _target(out: str | os.PathLike) -> Path:
    """``out`` as a path with a name: ``.``, ``./``, ``..`` name an existing directory by a
    spelling that has none, and the temporary beside the target needs one."""
    if not os.fspath(out):
        raise UsageError("the output path is empty")
    path = Path(out)
    return Path(os.path.abspath(path)) if path.name in ("", ".", "..") else path


def _refuse_joining(out: Path, plan: Plan) -> None:
    """A file output written into the source's own directory, where it would be read as one
    of its shards from then on, is refused: the source would no longer open as it did."""
    src = plan.source
    if isinstance(src.path, UrlPath) or src.path.is_file():
        return  # a remote source, or one file asked for: what lies beside it is no part of it
    if out.parent.resolve() in (src.root.resolve(), src.path.resolve()) and joins_shards(out.parent, out.name):
        raise OutputError(
            "is inside the source checkpoint's directory and would be read as one of its shards from then on; "
            "write it elsewhere",
            out,
        )


def _casts(plan: Plan, device: str | None) -> bool:
    """Whether the run needs its caster made before writing: it casts, or it names a device,
    which must be there even when nothing is cast (the run would say nothing of it otherwise)."""
    return device not in (None, "cpu") or any(t.is_cast for t in plan.tensors)


def _caster(writer: ShardWriter) -> None:
    """Make the run's caster now: torch, an optional dependency, may not be installed."""
    try:
        writer.get_caster()
    except ModuleNotFoundError as e:
        if e.name != "torch":
            raise
        what = f"casting on {writer.device}" if writer.device not in (None, "cpu") else "casting"
        raise UsageError(f"{what} needs torch, which is not installed: pip install 'streamck[cast]'") from None


def _extras(plan: Plan, shards: list[Shard]) -> dict[str, Path | bytes]:
    """Every file of a directory output but the shards: the index (when sharded), the
    plan's files and its side files (the plan's own win over copies)."""
    files = dict(plan.files)
    if len(shards) > 1:
        files[TORCH_INDEX_NAME if shards[0].format == "torch" else INDEX_NAME] = index_bytes(shards)
    return {**plan.side_files, **files}


def _put(data: Path | bytes, dest: Path, replace: bool = False) -> None:
    """Write bytes, copy a file, or copy a folder whole (a sentence-transformers module)
    to ``dest``, then fsync what was written."""
    if isinstance(data, bytes):
        dest.write_bytes(data)
    elif isinstance(data, UrlPath):  # a remote side file (small: a config, a tokenizer), or a folder of them
        if data.is_dir():
            dest.mkdir(exist_ok=replace)
            for entry in data.iterdir():
                _put(entry, dest / entry.name, replace)
        else:
            dest.write_bytes(data.read_bytes())
    elif data.is_dir():
        shutil.copytree(data, dest, dirs_exist_ok=replace)
    else:
        shutil.copyfile(data, dest)
    for path in [dest, *dest.rglob("*")] if dest.is_dir() else [dest]:
        _fsync(path)


def _write_extras(plan: Plan, shards: list[Shard], directory: Path) -> list[str]:
    """The index, the plan's files and its side files into ``directory``, fsynced; their names."""
    extras = _extras(plan, shards)
    for name, data in extras.items():
        _put(data, directory / name)
    return sorted(extras)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _to_stdout(
    plan: Plan,
    header_align: int,
    device: str | None,
    verify: bool,
    chunk: int,
    max_shard_size: int | None,
    progress: bool | str | Silent,
) -> WriteResult:
    """One safetensors file on stdout, strictly sequential (header first, no seeks)."""
    if max_shard_size is not None or verify or plan.files:
        what = "--max-shard-size" if max_shard_size is not None else "--verify" if verify else ", ".join(plan.files)
        raise OutputError(f"a stream holds one safetensors file and cannot be re-read: drop {what}", "-")
    fd = sys.stdout.fileno()
    if os.isatty(fd):
        raise OutputError("refusing to write a binary checkpoint to a terminal; redirect or pipe it", "-")
    sys.stdout.flush()
    (shard,) = plan_shards(plan, "-", None, header_align)
    bar = reporter(plan.total_size, progress)
    writer = ShardWriter(chunk, device, drop_cache=False, progress=bar, started=bar.tensor)
    if _casts(plan, device):
        _caster(writer)
    try:
        writer.write(shard, fd)
    except BrokenPipeError:
        raise  # the reader went away: the CLI says so in its own words
    except OSError as e:
        raise OutputError(f"write failed: {e.strerror or e}", e.filename or "stdout") from None
    finally:
        writer.close()
        bar.close()
    if plan.source is not None:
        plan.source.check_unchanged()
    return WriteResult([Path("-")], plan.total_size, writer.overflow, tensors=len(plan.tensors))
