"""Write a compiled plan: one sequence over a format (what the files hold) and a
destination (where they go); headers first, then every tensor's bytes, chunk by chunk."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from streamck.errors import TORCH_HINT, OutputError, UsageError
from streamck.gcpause import paused
from streamck.plan import Plan
from streamck.source.layout import joins_shards
from streamck.storage import UrlPath, is_url, location
from streamck.units import parse_size
from streamck.writer import formats
from streamck.writer.destination import Destination, LocalTarget, PartTarget, Stdout
from streamck.writer.formats.base import Format
from streamck.writer.options import WriteOptions
from streamck.writer.progress import reporter
from streamck.writer.shardwriter import ShardWriter, Workers

__all__ = ["WriteResult", "parse_size", "write_plan"]


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
    plan: Plan | None = None  # as the format wrote it (GGUF's, MLX's names, types and transforms)

    @property
    def copied(self) -> int:
        """Tensor bytes written (copied or cast) rather than shared."""
        return self.total_size - self.shared


def file_format(out: Path) -> str | None:
    """The format a file target's name asks for, or None for a directory target."""
    return formats.named_by(out)


def write_plan(plan: Plan, out: str | os.PathLike, options: WriteOptions | None = None, **changes) -> WriteResult:
    """Write ``plan`` to ``out`` as ``options`` say (streamck.writer.options.WriteOptions;
    ``changes`` are its fields over them, the older keyword spelling).

    A file name that asks for a format (``*.safetensors``; ``*.bin``, ``.pt``, ``.pth``: a
    torch.save archive; ``*.gguf``) is one file of it; any other path is a directory holding
    ``model.safetensors`` (or the format's one file), or numbered shards and an index when
    ``max_shard_size`` splits it, and the plan's extra files; ``"-"`` is one safetensors file
    on stdout; a URL (``s3://…``) is written by multipart uploads completed at the end.

    In order: the format prepares and checks the plan and lays it out in files
    (streamck.writer.formats); the destination checks the target and arranges the files for
    it (streamck.writer.destination); then, under the destination's temporary, every file is
    written (``jobs`` at once), synced, checked for lossy casts (``strict``) and verified
    (``verify``), the extra files put beside them and the source checked unchanged, and the
    output committed. On any error or signal nothing is left at ``out``.

    Where the output's filesystem can share blocks (XFS with reflink, btrfs…), headers are
    padded so that unchanged tensors lie in step with their source, and their bytes are
    shared rather than copied (streamck.writer.clone); elsewhere the layout is the
    reference writer's. Memory stays near ``chunk`` bytes per job whatever the tensor sizes.
    Raises StreamckError (OutputError for refused targets).
    """
    options = WriteOptions.of(options, **changes)
    target = "-" if os.fspath(out) == "-" else location(out) if is_url(out) else _target(out)
    fmt, single = formats.choose(options.format, target)
    plan = fmt.prepare(plan, options)
    _check(plan, fmt, single, target, options)
    with paused():  # headers and layouts: a few objects per tensor (see streamck.gcpause)
        shards = fmt.layout(plan, target.name if single else fmt.single_name, options)
    dest = _destination(target, plan, options, single)
    dest.check(shards, sorted(fmt.extras(plan, shards)))
    mine = dest.arrange(shards)  # a part's share; padded to share the source's blocks
    bar = reporter(plan.total_size, options.progress, kinds=work_kinds(plan), verify=options.verify)
    drop = options.drop_cache and target != "-"  # a pipe has no pages to drop
    workers = Workers(options.jobs, options.chunk, options.device, drop, bar, dest.sharing)
    try:
        if _casts(plan, options.device):
            _caster(workers.first)  # a missing torch or CUDA device is an error before any file exists
        with dest.open():
            workers.map(dest.write, mine)
            dest.written(workers)
            dest.put(fmt.extras(plan, shards))
            if plan.source is not None:
                plan.source.check_unchanged()
    except OSError as e:
        if isinstance(e, BrokenPipeError) and target == "-":
            raise
        raise OutputError(f"write failed: {e.strerror or e}", e.filename or out) from None
    finally:
        workers.close()
        bar.close()
    tensors = [t for s in mine for t in s.tensors]
    size = sum(t.nbytes for t in tensors)
    return WriteResult(dest.files(), size, workers.overflow, workers.shared, len(tensors), plan)


def _check(plan: Plan, fmt: Format, single: bool, target: Path | UrlPath | str, options: WriteOptions) -> None:
    """What no destination of this format can take, refused before the target is looked at."""
    if target == "-" and not fmt.streams:
        raise UsageError(f"-o - streams one safetensors file; write {fmt.title} to a path")
    fmt.check(plan, options, target)
    if single and options.max_shard_size is not None and not fmt.splits:
        raise OutputError(f"{{max_shard_size}} needs a directory output, not a {target.suffix} file", target)
    if single and plan.files:
        raise OutputError(f"this plan also writes {', '.join(plan.files)}; give a directory output", target)
    if single and options.part is not None:
        raise UsageError(f"{{part}} splits a directory output's files; {target.name} is one file")
    if options.verify and not fmt.verifies:
        raise UsageError(f"{{verify}} does not read {fmt.title} back yet")
    if single and plan.source is not None and isinstance(target, Path):
        _refuse_joining(target, plan)


def _destination(target: Path | UrlPath | str, plan: Plan, options: WriteOptions, single: bool) -> Destination:
    if target == "-":
        return Stdout(target, plan, options)
    if isinstance(target, UrlPath):
        from streamck.writer.remote import Bucket

        return Bucket(target, plan, options, single)
    if options.part is not None:
        return PartTarget(target, plan, options)
    return LocalTarget(target, plan, options, single)


def work_kinds(plan: Plan) -> dict[str, tuple[str, int]]:
    """Each output tensor's kind of work (``copy``, ``cast``, or its transform's class) and
    bytes, for the progress log's time left: the kinds go at very different rates."""
    return {
        t.name: (type(t.transform).__name__ if t.transform is not None else "cast" if t.is_cast else "copy", t.nbytes)
        for t in plan.tensors
    }


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
        raise UsageError(f"{what} needs torch, which is not installed: {TORCH_HINT}") from None
