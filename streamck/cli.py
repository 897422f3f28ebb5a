"""The ``streamck`` command: a thin layer over the library."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from streamck import manifest
from streamck.cli_args import build_parser
from streamck.cli_show import print_checkpoint, print_plan
from streamck.errors import Info, StreamckError, UsageError
from streamck.source.producers import plan_hint
from streamck.storage import is_url, requests_in_flight
from streamck.units import human, is_bare_bytes

if TYPE_CHECKING:
    from streamck.check.diff import Side
    from streamck.plan import Plan
    from streamck.source import Checkpoint
    from streamck.spec import SourceSpec


def _note(ckpt: Checkpoint, quiet: bool = False) -> Checkpoint:
    """Print a checkpoint's notices (items skipped as not tensors, a key or source chosen);
    ``quiet`` keeps those that ask for action (not Info)."""
    for line in ckpt.notices:
        if not (quiet and isinstance(line, Info)):
            print(f"streamck: note: {line}", file=sys.stderr)
    return ckpt


def _spec(args: argparse.Namespace, path: str | None = None, zero: bool | None = None) -> SourceSpec:
    """The command's source and how to read it (its source options), as the library takes it."""
    from streamck.spec import SourceSpec

    return SourceSpec(
        args.src if path is None else path,
        step=args.step,
        key=args.key,
        zero=args.zero if zero is None else zero,
        keep_tied=args.keep_tied,
        plan=args.plan,
        hf_config=args.hf_config,
        verifier=args.verifier,
        aux_layer_ids=args.aux_layer_ids,
        remote_concurrency=args.remote_concurrency,
    )


def _notes(plan: Plan, quiet: bool = False) -> Plan:
    """Print a plan's notices and its source's (see _note)."""
    if plan.source is not None:
        _note(plan.source, quiet)
    for line in plan.notices:
        if not (quiet and isinstance(line, Info)):
            print(f"streamck: note: {line}", file=sys.stderr)
    return plan


def _cmd_ls(args: argparse.Namespace) -> int:
    spec = _spec(args)
    if spec.plan is not None:  # what the plan would write
        plan = _notes(spec.compile(), args.quiet)
        if args.json:
            sys.stdout.write(manifest.dumps(manifest.plan_manifest(plan)))
        else:
            print_plan(plan)
        return 0
    ckpt = _note(spec.open(), args.quiet)
    hint = plan_hint(ckpt.tensors)
    if args.json:
        sys.stdout.write(manifest.dumps(manifest.checkpoint_manifest(ckpt)))
        if hint:
            print(f"streamck: note: {hint}", file=sys.stderr)
        return 0
    print_checkpoint(ckpt, hint)
    return 0


def _plan_options(args: argparse.Namespace):
    """The command's plan options (streamck.plan.options.PlanOptions)."""
    from streamck.plan.options import PlanOptions

    return PlanOptions(
        rules=args.rules or (),
        dtype=args.dtype,
        copy_files=not args.no_copy_files,
        merge_lora=args.merge_lora,
        safe_merge=args.safe_merge,
        merge_lora_any_base=args.merge_lora_any_base,
        merge_engine=args.merge_engine,
        experts=args.experts,
        quantize=args.quantize,
        quantize_ignore=args.quantize_ignore or (),
        quantize_lm_head=args.quantize_lm_head,
        quantize_pad_partial=args.quantize_pad_partial,
    )


def _write_options(args: argparse.Namespace):
    """The command's write options (streamck.writer.options.WriteOptions)."""
    from streamck.writer.options import WriteOptions

    return WriteOptions(
        format=args.format,
        max_shard_size=args.max_shard_size,
        keep_shards=args.keep_shards,
        header_align=args.header_align,
        force=args.force,
        verify=args.verify,
        strict=args.strict,
        device=args.device,
        jobs=args.jobs,
        part=args.part,
        drop_cache=args.drop_cache,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        group_size=args.group_size,
        progress=args.progress or ("none" if args.quiet else "auto"),
    )


def _cmd_rewrite(args: argparse.Namespace) -> int:
    from streamck.api import rewrite

    # Argument mistakes are said before the checkpoint is indexed (a large one takes a while).
    if not args.dry_run and args.output is None:
        raise UsageError("rewrite needs -o OUT (or --dry-run)")
    if not args.dry_run and args.output == "-" and args.json:
        raise UsageError("-o - puts the checkpoint on stdout; --json cannot go there too")
    options = _write_options(args)
    if args.max_shard_size and is_bare_bytes(args.max_shard_size) and not args.quiet:
        n = args.max_shard_size.strip()
        print(f"streamck: note: --max-shard-size {n} is {n} bytes; write {n}MB or {n}GB for more", file=sys.stderr)
    if args.dry_run:
        return _dry_run(args, _plan_options(args), options)
    plans = []
    started = time.monotonic()
    result = rewrite(
        _spec(args),
        args.output,
        plan_options=_plan_options(args),
        write_options=options,
        on_plan=lambda plan: plans.append(_notes(plan, args.quiet)),
    )
    _report(args, result, plans[0], options, time.monotonic() - started)
    return 0


def _dry_run(args: argparse.Namespace, plan_options, options) -> int:
    """``--dry-run``: the plan's notices, then the plan as the output's format writes it
    (refused as writing it would be)."""
    from streamck.api import build_plan
    from streamck.writer import formats

    fmt, _ = formats.choose(options.format, args.output or "-")
    plan_options, options = formats.route_types(fmt, plan_options, options)
    plan = _notes(build_plan(_spec(args), plan_options), args.quiet)
    if args.output and args.output != "-":
        plan = fmt.prepare(plan, options)
        fmt.check(plan, options, args.output)  # as writing would
    if args.json:
        sys.stdout.write(manifest.dumps(manifest.plan_manifest(plan)))
    else:
        print_plan(plan)
    return 0


def _work(plan: Plan) -> str:
    """What was done to the tensors, by kind: ``30 cast to bf16, 4 quantized (Fp8Block), 2 copied``."""
    kinds: dict[str, int] = {}
    for t in plan.tensors:
        if t.transform is not None:
            kind = f"computed ({t.transform.label.strip('+') or type(t.transform).__name__})"
        else:
            kind = f"cast to {t.dtype.lower()}" if t.is_cast else "copied"
        kinds[kind] = kinds.get(kind, 0) + 1
    return ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items(), key=lambda kv: -kv[1]))


def _report(args: argparse.Namespace, result, plan: Plan, options, seconds: float) -> None:
    """What the rewrite did: lossy casts as warnings, then one closing line (or the JSON report)."""
    for name, count in sorted(result.overflow.items()):
        print(f"streamck: warning: {name}: {count} finite values became inf in the cast", file=sys.stderr)
    if args.json:
        report = {
            "files": [str(f) for f in result.files],
            "overflow": dict(sorted(result.overflow.items())),
            "tensors": result.tensors,
            "total_size": result.total_size,
            "shared_bytes": result.shared,
            "copied_bytes": result.copied,
        }
        print(json.dumps(report, indent=2, sort_keys=True))
    elif not args.quiet:
        verb = "uploaded" if is_url(args.output) else "streamed" if args.output == "-" else "wrote"
        wrote = f"{verb} {result.tensors} tensors, {human(result.total_size)} to {args.output}"
        if options.part is not None:
            k, n = options.part
            shards = sum(f.suffix in (".safetensors", ".bin") for f in result.files)
            wrote = f"part {k}/{n}: {shards} shards, {result.tensors} of {len(plan.tensors)} tensors, "
            wrote += f"{human(result.total_size)} of {human(plan.total_size)} to {args.output}"
        moved = f"{human(result.shared)} shared with the source, {human(result.copied)} copied"
        done = f"{_work(result.plan or plan)}{', verified' if options.verify else ''}"
        print(f"{wrote} in {seconds:.1f} s ({moved}): {done}", file=sys.stderr)


def _cmd_diff(args: argparse.Namespace) -> int:
    from streamck.check import diff

    a = _side(args.a, args, args.zero or args.zero_a)
    b = _side(args.b, args, args.zero or args.zero_b)
    result = diff(a, b, ignore=tuple(args.ignore or ()), data=args.data)
    args.status = 0 if result.equal else 1  # the answer, even if stdout closes (diff A B | head)
    if args.quiet and result.equal:
        return 0  # quiet means quiet: the exit status is the answer
    if args.json:
        print(json.dumps(result.to_json(), indent=2, sort_keys=True))
    else:
        print(result)
    return args.status


def _side(path: str, args: argparse.Namespace, zero: bool) -> Side:
    """One side of ``diff``, its notices on stderr."""
    from streamck.api import load_side

    side = load_side(_spec(args, path, zero))
    if side.checkpoint is not None:
        _note(side.checkpoint, args.quiet)
    return side


def _cmd_hash(args: argparse.Namespace) -> int:
    if args.output and is_url(args.output):
        raise UsageError(f"hash -o {args.output}: the manifest is written to a local file (or stdout) only")
    spec = _spec(args)
    if spec.plan is None:
        from streamck.check.digest import hash_manifest

        ckpt = _note(spec.open(), args.quiet)
        _refuse_source(args.output, ckpt.files)  # before the hashing, which reads every byte
        m = hash_manifest(ckpt)
    else:
        from streamck.writer import plan_digests

        plan = _notes(spec.compile(), args.quiet)
        _refuse_source(args.output, plan.source.files if plan.source else [])
        m = plan_digests(plan)
    text = manifest.dumps(m) if args.json else "".join(f"{e['sha256']}  {n}\n" for n, e in m["tensors"].items())
    if args.output:
        from streamck.writer.atomic import atomic_output

        with atomic_output(Path(args.output), is_dir=False, force=True) as tmp:
            tmp.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def _refuse_source(output: str | None, sources: list) -> None:
    """``-o`` that is (or holds) a source file is refused: the manifest would replace the weights."""
    if output:
        from streamck.writer.atomic import refuse_source

        refuse_source(Path(output), sources)


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


def _cmd_completion(args: argparse.Namespace) -> int:
    from streamck.cli_complete import script

    sys.stdout.write(script(args.shell, build_parser()))
    return 0


COMMANDS = {"ls": _cmd_ls, "rewrite": _cmd_rewrite, "diff": _cmd_diff, "hash": _cmd_hash, "completion": _cmd_completion}


def main(argv: list[str] | None = None) -> int:
    args = None
    try:
        args = build_parser().parse_args(argv)
        # The CLI owns the process: SIGTERM/SIGHUP unwind like Ctrl-C, so outputs are cleaned up.
        with signals_as_exceptions(), requests_in_flight(getattr(args, "remote_concurrency", None)):
            code = COMMANDS[args.command](args)
            sys.stdout.flush()  # a closed pipe shows here rather than in the flush at exit
        return code
    except StreamckError as e:
        print(f"streamck: error: {e.cli()}", file=sys.stderr)
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
