"""An output that appears under its final name complete, or not at all.

Everything is written under a temporary name beside the target, fsynced, then
renamed into place. Temporary names carry the writer's pid, so a later run can
tell a dead writer's leftovers from a live one's and remove only the former.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from streamck.errors import OutputError

TMP_TAG = ".streamck-tmp-"
_TMP_RE = re.compile(r"^\..*\.streamck-(?:tmp|old)-(\d+)-[0-9a-f]{8}$")


class Interrupted(BaseException):
    """A terminating signal arrived; ``code`` is the shell's exit status for it."""

    def __init__(self, signum: int):
        self.code = 128 + signum
        super().__init__(signal.Signals(signum).name)


@contextmanager
def signals_as_exceptions() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP into Interrupted (SIGINT already raises KeyboardInterrupt),
    so that cleanup runs on the way out."""

    def handler(signum, frame):
        raise Interrupted(signum)

    saved = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(directory: Path) -> list[Path]:
    """Remove temporary outputs left in ``directory`` by streamck runs that are no longer alive."""
    removed = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return removed
    for entry in entries:
        m = _TMP_RE.match(entry.name)
        if m and not _alive(int(m.group(1))):
            _remove(entry)
            removed.append(entry)
    return removed


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _sibling(final: Path, kind: str) -> Path:
    return final.with_name(f".{final.name}.streamck-{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_target(final: Path, sources: Iterable[Path], is_dir: bool, force: bool) -> None:
    """Refuse a target that is, links to, or would contain a source file, or that exists
    (unless ``force``, or it is an empty directory and a directory is to be written)."""
    resolved = final.resolve()
    exists = final.exists()
    target = os.stat(final) if exists else None
    for src in sources:
        src_resolved = src.resolve()
        if src_resolved == resolved or resolved in src_resolved.parents:
            raise OutputError("refusing to write over the source checkpoint", final)
        if target is not None and os.path.samestat(target, os.stat(src)):
            raise OutputError(f"refusing to write over the source checkpoint (same file as {src})", final)
    if final.is_symlink() or exists:
        if is_dir and final.is_dir() and not final.is_symlink() and not any(final.iterdir()):
            return
        if not force:
            raise OutputError("already exists; pass --force to replace it", final)


@contextmanager
def atomic_output(final: Path, is_dir: bool, force: bool) -> Iterator[Path]:
    """Yield a temporary path (a new directory if ``is_dir``) beside ``final``; on a clean
    exit move it into place, on any exception or signal remove it."""
    parent = final.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot create output directory: {e.strerror}", parent) from None
    remove_stale(parent)
    tmp = _sibling(final, "tmp")
    try:
        if is_dir:
            tmp.mkdir()
        else:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except OSError as e:
        raise OutputError(f"cannot write here: {e.strerror}", parent) from None
    try:
        yield tmp
        _commit(tmp, final, is_dir, force)
        fsync_dir(parent)
    except BaseException:
        _remove(tmp)
        raise


def _commit(tmp: Path, final: Path, is_dir: bool, force: bool) -> None:
    if not is_dir:
        if force:
            os.replace(tmp, final)
            return
        try:
            os.link(tmp, final)  # unlike rename, never replaces what a racing run put there
        except FileExistsError:
            raise OutputError("appeared while writing (another run?); pass --force to replace it", final) from None
        tmp.unlink()
        return
    try:
        os.rename(tmp, final)  # succeeds over an empty directory only
        return
    except OSError:
        if not force or not (final.exists() or final.is_symlink()):
            raise OutputError("appeared while writing (another run?); pass --force to replace it", final) from None
    old = _sibling(final, "old")
    os.rename(final, old)
    os.rename(tmp, final)
    _remove(old)
