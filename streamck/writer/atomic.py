"""An output that appears under its final name complete, or not at all.

Everything is written under a temporary name beside the target, fsynced, then
renamed into place. Each run holds an advisory lock (``flock``) for its whole
life on a lock file: inside its temporary directory, or, for a single-file
target, beside its temporary file under the same unique tag. A later run
removes a temporary only when it can take that lock itself, which is true only
once its owner has ended, whatever pid namespace or host (on a filesystem that
shares flock locks) the owner ran in. A temporary without a lock file (left by
a streamck from before these locks, or caught in the moment between its lock's
removal and its rename) is left alone unless untouched for ``STALE_AGE``.
"""

from __future__ import annotations

import fcntl
import fnmatch
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from streamck.errors import OutputError
from streamck.fileio import fsync as fsync_dir
from streamck.storage import UrlPath

TMP_TAG = ".streamck-tmp-"
LOCK_NAME = ".streamck-lock"  # inside a temporary directory
STALE_AGE = 24 * 3600  # seconds untouched before a temporary without a lock file counts as dead
_TMP_RE = re.compile(r"^(\..*\.streamck-)(tmp|lock)(-\d+-[0-9a-f]{8})$")
# What an earlier export left that --force may remove, by the names an export writes (as
# save_pretrained removes its stale shards by their names): any other file is the user's and stays.
INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_SHARD = "-[0-9][0-9][0-9][0-9][0-9]-of-[0-9][0-9][0-9][0-9][0-9]"
STALE_WEIGHTS = (
    "model.safetensors", f"model{_SHARD}.safetensors", "pytorch_model.bin", f"pytorch_model{_SHARD}.bin", *INDEX_FILES,
)  # fmt: skip


def _try_lock(lock: Path) -> int | None:
    """A descriptor holding ``lock`` exclusively; None if another process holds it or it cannot be opened."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW)  # NFS emulates flock with fcntl locks: LOCK_EX needs write
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _untouched(path: Path, seconds: float) -> bool:
    try:
        return time.time() - path.lstat().st_mtime > seconds
    except OSError:
        return False


def remove_stale(directory: Path) -> list[Path]:
    """Remove the temporary outputs in ``directory`` whose runs have ended: those whose lock
    this process can take (removed while holding it, so their owner can tell), and those
    without a lock file untouched for ``STALE_AGE``. Anything in doubt is left."""
    removed = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return removed
    for entry in entries:
        m = _TMP_RE.match(entry.name)
        if m is None:
            continue
        tmp, sibling = (directory / f"{m[1]}{kind}{m[3]}" for kind in ("tmp", "lock"))
        if entry == sibling and os.path.lexists(tmp):
            continue  # judged with its temporary
        lock = tmp / LOCK_NAME if tmp.is_dir() and not tmp.is_symlink() else sibling
        fd = _try_lock(lock)
        if fd is None and (os.path.lexists(lock) or not _untouched(entry, STALE_AGE)):
            continue  # alive, not ours to judge, or too young to call dead without a lock
        try:
            _remove(tmp)
            _remove(sibling)
        finally:
            if fd is not None:
                os.close(fd)
        removed.append(entry)
    return removed


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _new_temp(final: Path, is_dir: bool) -> tuple[Path, Path, int]:
    """A new temporary beside ``final``, its lock file, and a descriptor holding the lock.

    A cleaner may lock a lock file between its creation and our flock; it then removes
    it before letting go, so the lock is ours only if the file is still there: else retry."""
    for _ in range(3):
        tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp = final.with_name(f".{final.name}{TMP_TAG}{tag}")
        lock = tmp / LOCK_NAME if is_dir else final.with_name(f".{final.name}.streamck-lock-{tag}")
        if is_dir:
            tmp.mkdir()
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)  # waits only while a cleaner that got there first removes it
        try:
            kept = os.path.samestat(os.stat(lock), os.fstat(fd))
        except FileNotFoundError:
            kept = False
        if kept:
            if not is_dir:  # created after the lock, so it is never there unguarded
                os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            return tmp, lock, fd
        os.close(fd)
    raise OutputError("temporary output removed by other runs as soon as it was made", final.parent)


def is_temporary(name: str) -> bool:
    """Whether ``name`` is a streamck run's temporary (its output, or its lock file)."""
    return _TMP_RE.match(name) is not None


def _is_weights(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, g) for g in STALE_WEIGHTS)


def refuse_source(final: Path, sources: Iterable[Path]) -> None:
    """Refuse a target that is, links to, or would contain a source file (a remote source
    file never is: it lies in no local folder)."""
    resolved = final.resolve()
    target = os.stat(final) if final.exists() else None
    for src in sources:
        if isinstance(src, UrlPath):
            continue
        src_resolved = src.resolve()
        if src_resolved == resolved or resolved in src_resolved.parents:
            raise OutputError("refusing to write over the source checkpoint", final)
        if target is not None and os.path.samestat(target, os.stat(src)):
            raise OutputError(f"refusing to write over the source checkpoint (same file as {src})", final)


EXISTS_DIR = (
    "already exists; pass {force} to write into it (an earlier export's weights are replaced, other files are kept)"
)


def check_target(final: Path, sources: Iterable[Path], is_dir: bool, force: bool) -> None:
    """Refuse a target that is, links to, or would contain a source file, or that exists
    (unless ``force``, or it is an empty directory and a directory is to be written).

    ``force`` replaces a file target; a directory it writes into, as ``save_pretrained``
    does: the output's files replace their namesakes, an earlier export's weights and
    indexes (``STALE_WEIGHTS``) go, and everything else there stays (``_merge``)."""
    refuse_source(final, sources)
    exists = final.exists()
    if not (final.is_symlink() or exists):
        return
    real_dir = final.is_dir() and not final.is_symlink()
    if not is_dir and real_dir:
        raise OutputError("is a directory; a .safetensors output is one file", final)
    if is_dir and not real_dir:
        raise OutputError("is not a directory; a directory output replaces only a directory", final)
    if is_dir and not any(final.iterdir()):
        return
    if not force:
        raise OutputError(EXISTS_DIR if is_dir else "already exists; pass {force} to replace it", final)


@contextmanager
def atomic_output(final: Path, is_dir: bool, force: bool) -> Iterator[Path]:
    """Yield a temporary path (a new directory if ``is_dir``) beside ``final``; on a clean
    exit move it into place, on any exception or signal remove it. A failure of the move
    or its fsync is an OutputError naming ``final``."""
    parent = final.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot create output directory: {e.strerror}", parent) from None
    remove_stale(parent)
    try:
        tmp, lock, fd = _new_temp(final, is_dir)
    except OSError as e:
        raise OutputError(f"cannot write here: {e.strerror}", parent) from None
    try:
        yield tmp
        try:
            if is_dir:
                lock.unlink()  # not part of the output; held (by descriptor) until the end
            _commit(tmp, final, is_dir, force)
            fsync_dir(parent)
        except OSError as e:
            raise OutputError(f"cannot move the finished output into place: {e.strerror or e}", final) from None
    except BaseException:
        _remove(tmp)
        raise
    finally:
        if not is_dir:
            lock.unlink(missing_ok=True)
        os.close(fd)


def _commit(tmp: Path, final: Path, is_dir: bool, force: bool) -> None:
    if not is_dir:
        if force:
            if final.is_dir() and not final.is_symlink():
                raise OutputError("became a directory while writing; a .safetensors output is one file", final)
            os.replace(tmp, final)
            return
        try:
            os.link(tmp, final)  # unlike rename, never replaces what a racing run put there
        except FileExistsError:
            raise OutputError("appeared while writing (another run?); pass {force} to replace it", final) from None
        tmp.unlink()
        return
    if final.is_dir() and not final.is_symlink():
        # An existing directory is filled, never swapped: it may be a shell's working directory or a mount point.
        if not force and any(final.iterdir()):
            raise OutputError("appeared while writing (another run?); pass {force} to replace it", final)
        _merge(tmp, final)
        return
    try:
        os.rename(tmp, final)
    except OSError:
        if force and final.is_dir() and not final.is_symlink():  # made meanwhile (a concurrent --part)
            _merge(tmp, final)
            return
        raise OutputError("appeared while writing (another run?); pass {force} to replace it", final) from None


def _merge(tmp: Path, final: Path) -> None:
    """Replace an earlier export in the existing directory ``final`` with the files in ``tmp``.

    The directory itself is never removed or swapped, so nothing else in it can go with
    it: each new file is renamed over its namesake, then the old weights this output does
    not have are removed. The old index goes first and the new one comes last, so that no index
    ever names a mix of old and new shards: a crash in between leaves shards without an
    index, which loaders refuse, never an index over the wrong weights."""
    if not final.is_dir() or final.is_symlink():
        raise OutputError("appeared while writing and is not a directory", final)
    new = [p.name for p in tmp.iterdir()]
    for index in INDEX_FILES:
        (final / index).unlink(missing_ok=True)
    fsync_dir(final)
    _move_into(tmp, final)
    for stale in _stale(final, new):
        stale.unlink(missing_ok=True)
    fsync_dir(final)


def _move_into(src: Path, dst: Path) -> None:
    """Rename every entry of ``src`` over its namesake in ``dst``, indexes last; ``src`` goes.

    A folder the output writes (``1_Pooling/``, a Megatron run's ``iter_0000000/``) replaces its
    namesake whole: the old one is renamed aside as a temporary, the new one renamed in, the old
    removed, so that no file of an earlier export (a shard it no longer has) is left inside it."""
    for entry in sorted(src.iterdir(), key=lambda e: e.name in INDEX_FILES):
        target = dst / entry.name
        if entry.is_dir() and target.is_dir() and not target.is_symlink():
            old = target.with_name(f".{target.name}{TMP_TAG}{os.getpid()}-{uuid.uuid4().hex[:8]}")
            os.rename(target, old)  # left by a crash, remove_stale takes it once it is STALE_AGE old
            os.rename(entry, target)
            _remove(old)
        else:
            os.replace(entry, target)
    fsync_dir(dst)
    src.rmdir()


def _stale(final: Path, new: list[str]) -> list[Path]:
    """The weights and indexes in ``final`` that the new output does not have."""
    return [p for p in final.iterdir() if p.name not in new and _is_weights(p.name)]
