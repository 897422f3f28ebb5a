"""The ``streamck`` command: a thin layer over the library."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from streamck import manifest
from streamck.cli_args import build_parser
from streamck.errors import Info, StreamckError, UsageError
from streamck.source import open_checkpoint

if TYPE_CHECKING:
    from streamck.check.diff import Side
    from streamck.source import Checkpoint


def human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError


def shape_str(shape) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def table(rows: list[tuple[str, ...]], out=sys.stdout) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        out.write("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() + "\n")


def _note(ckpt: Checkpoint, quiet: bool = False) -> Checkpoint:
    """Print a checkpoint's notices (items skipped as not tensors, a key or source chosen);
    ``quiet`` keeps those that ask for action (not Info)."""
    for line in ckpt.notices:
        if not (quiet and isinstance(line, Info)):
            print(f"streamck: note: {line}", file=sys.stderr)
    return ckpt


def _open(args: argparse.Namespace, src: str | os.PathLike | None = None) -> Checkpoint:
    """The command's source, opened with its --step, --key, --zero and --keep-tied."""
    path = args.src if src is None else src
    return _note(open_checkpoint(path, getattr(args, "step", None), args.key, args.zero, args.keep_tied))


def _files(t, root: Path) -> str:
    if not t.paths:  # a tensor of no elements read as tiles lies in no file
        return "-"
    first = os.path.relpath(t.path, root)
    return first if len(t.paths) == 1 else f"{first} (+{len(t.paths) - 1} more)"


def _cmd_ls(args: argparse.Namespace) -> int:
    ckpt = _open(args)
    if args.json:
        sys.stdout.write(manifest.dumps(manifest.checkpoint_manifest(ckpt)))
        return 0
    rows = [("NAME", "DTYPE", "SHAPE", "BYTES", "FILE")]
    rows += [
        (t.name, t.dtype, shape_str(t.shape), str(t.nbytes), _files(t, ckpt.root))
        for t in sorted(ckpt.tensors.values(), key=lambda t: t.name)
    ]
    table(rows)
    from streamck.plan.moe.blocks import layout_line

    moe = layout_line({t.name: t.shape for t in ckpt.tensors.values()})
    if moe:
        print(moe)
    print(
        f"{len(ckpt.tensors)} tensors in {len(ckpt.files)} file(s) "
        f"{'under ' + str(ckpt.root) if ckpt.path.is_dir() else 'in ' + str(ckpt.path)}, {human(ckpt.total_size)} "
        f"({ckpt.total_size} bytes)"
    )
    return 0


def _compile(args: argparse.Namespace):
    """The plan for ``rewrite`` (streamck.build_plan), the source's and its own notices on stderr."""
    from streamck.api import build_plan

    plan = build_plan(
        args.src,
        rules=args.rules or (),
        plan=args.plan,
        dtype=args.dtype,
        step=args.step,
        key=args.key,
        zero=args.zero,
        keep_tied=args.keep_tied,
        copy_files=not args.no_copy_files,
        verifier=args.verifier,
        aux_layer_ids=args.aux_layer_ids,
        hf_config=args.hf_config,
        merge_lora=args.merge_lora,
        safe_merge=args.safe_merge,
        merge_lora_any_base=args.merge_lora_any_base,
        merge_engine=args.merge_engine,
        experts=args.experts,
    )
    if plan.source is not None:
        _note(plan.source, getattr(args, "quiet", False))
    for line in plan.notices:
        print(f"streamck: note: {line}", file=sys.stderr)
    return plan


def _print_plan(plan) -> None:
    for line in plan.summary:
        print(line)
    rows = [("SOURCE", "OUTPUT", "DTYPE", "SHAPE", "BYTES")]
    for t in plan.tensors:
        src = t.transform.origin(t.source) if t.transform is not None else t.source
        dtype = f"{src.dtype}->{t.dtype}" if t.dtype != src.dtype else t.dtype
        dtype += f" {t.transform.label}" if t.transform is not None and t.transform.label else ""
        rows.append((src.name, t.name, dtype, shape_str(t.shape), str(t.nbytes)))
    table(rows)
    src = plan.source
    dropped = len(src.tensors) - len(plan.tensors) if src else 0
    counts = f"{dropped} dropped" if dropped >= 0 else f"from {len(src.tensors)} source tensors"  # experts split
    print(f"{len(plan.tensors)} tensors ({counts}), {human(plan.total_size)} ({plan.total_size} bytes)")


def _cmd_rewrite(args: argparse.Namespace) -> int:
    from streamck.writer import parse_size, write_plan
    from streamck.writer.parts import parse_part

    # Argument mistakes are said before the checkpoint is indexed (a large one takes a while).
    if not args.dry_run and args.output is None:
        raise UsageError("rewrite needs -o OUT (or --dry-run)")
    if not args.dry_run and args.output == "-" and args.json:
        raise UsageError("-o - puts the checkpoint on stdout; --json cannot go there too")
    size = parse_size(args.max_shard_size) if args.max_shard_size else None
    part = parse_part(args.part) if args.part else None
    plan = _compile(args)
    if args.dry_run:
        from streamck.writer.engine import file_format
        from streamck.writer.torchsave import refuse_unsaveable

        if "torch" in (args.format, args.output and args.output != "-" and file_format(Path(args.output))):
            refuse_unsaveable(plan.tensors)  # as writing would
        if args.json:
            sys.stdout.write(manifest.dumps(manifest.plan_manifest(plan)))
        else:
            _print_plan(plan)
        return 0
    result = write_plan(
        plan,
        args.output,
        max_shard_size=size,
        header_align=args.header_align,
        force=args.force,
        drop_cache=args.drop_cache,
        device=args.device,
        verify=args.verify,
        progress=not args.quiet and sys.stderr.isatty(),
        format=args.format,
        jobs=args.jobs,
        part=part,
        keep_shards=args.keep_shards,
    )
    for name, count in sorted(result.overflow.items()):
        print(f"streamck: warning: {name}: {count} finite values became inf in the cast", file=sys.stderr)
    if args.json:
        report = {
            "files": [str(f) for f in result.files],
            "overflow": dict(sorted(result.overflow.items())),
            "tensors": len(plan.tensors),
            "total_size": result.total_size,
            "shared_bytes": result.shared,
            "copied_bytes": result.copied,
        }
        print(json.dumps(report, indent=2, sort_keys=True))
    elif not args.quiet:
        wrote = f"wrote {len(plan.tensors)} tensors, {human(result.total_size)} to {args.output}"
        moved = f"{human(result.shared)} shared with the source, {human(result.copied)} copied"
        print(f"{wrote} ({moved})", file=sys.stderr)
    return 0


def _cmd_diff(args: argparse.Namespace) -> int:
    from streamck.check import diff

    a = _side(args.a, args, args.zero or args.zero_a)
    b = _side(args.b, args, args.zero or args.zero_b)
    result = diff(a, b, ignore=tuple(args.ignore or ()), data=args.data)
    args.status = 0 if result.equal else 1  # the answer, even if stdout closes (diff A B | head)
    if args.json:
        print(json.dumps(result.to_json(), indent=2, sort_keys=True))
    else:
        print(result)
    return args.status


def _side(path: str, args: argparse.Namespace, zero: bool) -> Side:
    """One side of ``diff``, its notices on stderr."""
    from streamck.check.diff import load_side

    side = load_side(path, key=args.key, zero=zero, keep_tied=args.keep_tied)
    if side.checkpoint is not None:
        _note(side.checkpoint)
    return side


def _cmd_hash(args: argparse.Namespace) -> int:
    from streamck.check.digest import hash_manifest

    m = hash_manifest(_open(args))
    text = manifest.dumps(m) if args.json else "".join(f"{e['sha256']}  {n}\n" for n, e in m["tensors"].items())
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


class Interrupted(BaseException):
    """A terminating signal arrived; ``code`` is the shell's exit status for it."""

    def __init__(self, signum: int):
        self.code = 128 + signum
        super().__init__(signal.Signals(signum).name)


@contextmanager
def signals_as_exceptions() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP into Interrupted (SIGINT already raises KeyboardInterrupt),
    so that cleanup runs on the way out. For the process's owner (the CLI's main
    thread): the library never installs handlers."""

    def handler(signum, frame):
        raise Interrupted(signum)

    saved = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


COMMANDS = {"ls": _cmd_ls, "rewrite": _cmd_rewrite, "diff": _cmd_diff, "hash": _cmd_hash}


def main(argv: list[str] | None = None) -> int:
    args = None
    try:
        args = build_parser().parse_args(argv)
        # The CLI owns the process: SIGTERM/SIGHUP unwind like Ctrl-C, so outputs are cleaned up.
        with signals_as_exceptions():
            code = COMMANDS[args.command](args)
            sys.stdout.flush()  # a closed pipe shows here rather than in the flush at exit
        return code
    except StreamckError as e:
        print(f"streamck: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("streamck: interrupted", file=sys.stderr)
        return 130
    except Interrupted as e:
        print(f"streamck: stopped by {e}", file=sys.stderr)
        return e.code
    except BrokenPipeError:
        # stdout went away: fine for a listing cut short (ls | head), and diff's answer stands;
        # a checkpoint on stdout (rewrite -o -) is incomplete.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # silence the flush at exit
        if args is not None and args.command == "rewrite" and args.output == "-" and not args.dry_run:
            print("streamck: error: stdout closed before the whole checkpoint was written", file=sys.stderr)
            return 2
        return getattr(args, "status", 0)
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        print(f"streamck: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2


def entry() -> None:
    # numpy's BLAS runs only --merge-engine numpy's GEMM (r products an element, memory-bound);
    # its second, spinning thread took 8.5 s of CPU for a 1 GiB merge that one thread does in
    # 1.6 (a 2-core VM). numpy reads this once, when first imported: not yet, here.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    sys.exit(main())


if __name__ == "__main__":
    entry()
