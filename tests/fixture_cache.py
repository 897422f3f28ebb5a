"""Producer fixtures kept on this machine between test runs and between clones (#45).

A fixture's folder is ``$STREAMCK_FIXTURE_CACHE`` (default ``~/.cache/streamck-fixtures``)
``/<what>-<key>``, the key a hash of the fixture's code (the files its builder runs) and of every
package installed in ``.venv`` (its own venvs and unpacked folders too), so a new producer
version, an edited fixture script or another branch's copy of it gets a folder of its own, never
a stale one. ``STREAMCK_COLD_FIXTURES=1`` builds every fixture afresh in pytest's temp dir (the
cache is neither read nor written): the cold figure, or a check that a fixture still builds.

``built_once`` builds into a fresh ``.partial-*`` folder beside the entry and renames it when
done, under a lock (two pytest processes never build the same entry; the second waits and uses
the first's); the ``done`` file lists every file with its size and mtime, and an entry whose
files no longer match it (a partial copy, a cleaner's work, a test that wrote into it) is rebuilt.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE_ENV, COLD_ENV = "STREAMCK_FIXTURE_CACHE", "STREAMCK_COLD_FIXTURES"
STALE_DAYS = 14  # entries of a fixture unused this long are removed when a new one of it is built
# The test runner's own tools, which no fixture runs: adding one does not rebuild every fixture.
RUNNER_ONLY = ("pytest_xdist-", "execnet-")
BUILT: list[tuple[str, float]] = []  # (entry, seconds) built by this process, for the run's summary


def cold() -> bool:
    """Whether this run builds every fixture afresh (``STREAMCK_COLD_FIXTURES`` set, not 0)."""
    return os.environ.get(COLD_ENV, "0") not in ("", "0")


def cache_dir() -> Path:
    """Where entries are kept on this machine."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "streamck-fixtures")


@functools.cache
def installed() -> str:
    """The Python version and every distribution installed in this interpreter's path and in
    ``.venv``'s own venvs and unpacked folders (verl's venv, megatron-core, OLMo-core…), hashed."""
    folders = [Path(entry or ".") for entry in sys.path]
    names = {p.name for folder in folders if folder.is_dir() for p in folder.glob("*.dist-info")}  # not where: a
    venv = REPO / ".venv"  # clone elsewhere on the machine, with the same versions, shares the entries
    for pattern in ("*/*.dist-info", "*/lib/python*/site-packages/*.dist-info"):
        names.update(str(p.relative_to(venv)) for p in venv.glob(pattern))
    names = {name for name in names if not Path(name).name.lower().startswith(RUNNER_ONLY)}
    text = "\n".join([sys.version, *sorted(names)])
    return hashlib.sha256(text.encode()).hexdigest()


def fixture_root(tmp_path_factory, what: str, *code: Path | str) -> Path:
    """The folder fixture ``what`` is built in: its cache entry for this ``code`` (files, relative
    to the repository or absolute) and the installed packages, or a fresh temp dir when cold."""
    digest = hashlib.sha256(installed().encode())
    for path in sorted(REPO / p for p in code):
        digest.update(f"\0{path.name}\0".encode() + path.read_bytes())
    # cold: in this run's temp dir, still once per run (the test files that import one fixture share it;
    # an xdist worker's temp dir is one of the run's, so the workers share its parent's)
    base = Path(tmp_path_factory.getbasetemp())
    base = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    where = base / "cold-fixtures" if cold() else cache_dir()
    root = where / f"{what}-{digest.hexdigest()[:16]}"
    root.mkdir(parents=True, exist_ok=True)
    return root


def _manifest(base: Path) -> dict[str, list[int]]:
    """Every file under ``base`` but ``done``, with its size and mtime."""
    out = {}
    for path in sorted(base.rglob("*")):
        if path.is_file() and not path.is_symlink() and path != base / "done":
            st = path.stat()
            out[str(path.relative_to(base))] = [st.st_size, st.st_mtime_ns]
    return out


def _intact(base: Path) -> bool:
    """Whether ``base`` is a finished entry whose files are all as its build left them."""
    try:
        files = json.loads((base / "done").read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    for name, (size, mtime) in files.items():
        try:
            st = (base / name).stat()
        except OSError:
            return False
        if st.st_size != size or st.st_mtime_ns != mtime:
            return False
    return True


def _prune(base: Path) -> None:
    """Remove other entries of the same fixture (``what-*``) not used for STALE_DAYS."""
    what = base.parent.name.rsplit("-", 1)[0]
    cutoff = time.time() - STALE_DAYS * 86400
    for other in base.parent.parent.glob(f"{what}-" + "?" * 16):  # not titan-moe-… for titan
        used = other / ".used"
        if other != base.parent and other.is_dir() and (not used.exists() or used.stat().st_mtime < cutoff):
            shutil.rmtree(other, ignore_errors=True)


def built_once(base: Path, build: Callable[[Path], object]) -> Path:
    """``base``, made by ``build(folder)`` unless a finished, intact entry is there: built in a
    fresh ``.partial-*`` folder beside it and renamed when done, under a lock on ``base``."""
    base.parent.mkdir(parents=True, exist_ok=True)
    with open(base.with_name(base.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when the process dies
        if not _intact(base):
            for stale in base.parent.glob(base.name + ".partial*"):  # left by a build that died
                shutil.rmtree(stale, ignore_errors=True)
            tmp = Path(tempfile.mkdtemp(prefix=base.name + ".partial-", dir=base.parent))
            tmp.chmod(0o755)  # mkdtemp's 0700 would keep the entry from other users of the machine
            start = time.monotonic()
            build(tmp)
            seconds = round(time.monotonic() - start, 1)
            BUILT.append((f"{base.parent.name}/{base.name}", seconds))
            (tmp / "done").write_text(json.dumps({"seconds": seconds, "files": _manifest(tmp)}) + "\n")
            shutil.rmtree(base, ignore_errors=True)
            tmp.rename(base)
            if base.parent.parent == cache_dir():
                _prune(base)
        if base.parent.parent == cache_dir():
            (base.parent / ".used").touch()
    return base
