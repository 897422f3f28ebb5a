"""The producer-fixture cache (tests/fixture_cache.py, #45): an entry is used only when its build
finished and its files are as it left them, two processes never build one entry at once, the key
follows the fixture's code, and STREAMCK_COLD_FIXTURES builds afresh outside the cache."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import fixture_cache
import pytest
from fixture_cache import built_once, fixture_root

HERE = Path(__file__).parent


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("STREAMCK_FIXTURE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("STREAMCK_COLD_FIXTURES", raising=False)
    monkeypatch.setattr(fixture_cache, "BUILT", [])  # the run's summary lists the real fixtures only
    return tmp_path / "cache"


def _builder(calls: list):
    def build(folder: Path) -> None:
        calls.append(folder)
        (folder / "case").mkdir()
        (folder / "case" / "weights.bin").write_bytes(b"\1" * 64)

    return build


def test_built_once_then_reused(cache, tmp_path_factory):
    calls = []
    base = fixture_root(tmp_path_factory, "demo", "tests/fixture_cache.py") / "demo"
    assert base.parent.parent == cache
    assert built_once(base, _builder(calls)) == base and len(calls) == 1
    assert fixture_cache.BUILT[-1][0] == f"{base.parent.name}/demo"
    assert calls[0] != base and not calls[0].exists()  # built beside it, then renamed
    assert built_once(base, _builder(calls)) == base and len(calls) == 1
    assert (base / "case" / "weights.bin").read_bytes() == b"\1" * 64
    assert not list(base.parent.glob("*.partial*"))


def test_a_build_that_dies_leaves_nothing_used(cache, tmp_path_factory):
    base = fixture_root(tmp_path_factory, "demo", "tests/fixture_cache.py") / "demo"

    def dies(folder: Path) -> None:
        (folder / "half").write_bytes(b"x")
        raise RuntimeError("producer crashed")

    with pytest.raises(RuntimeError, match="producer crashed"):
        built_once(base, dies)
    assert not base.exists()
    calls = []
    built_once(base, _builder(calls))
    assert len(calls) == 1 and not (base / "half").exists()
    assert not list(base.parent.glob("*.partial*"))  # the dead build's folder is cleared


@pytest.mark.parametrize("damage", ["done", "truncated", "deleted", "rewritten"])
def test_a_damaged_entry_is_rebuilt(damage, cache, tmp_path_factory):
    base = fixture_root(tmp_path_factory, "demo", "tests/fixture_cache.py") / "demo"
    calls = []
    built_once(base, _builder(calls))
    weights = base / "case" / "weights.bin"
    if damage == "done":
        (base / "done").write_text("{")
    elif damage == "truncated":
        weights.write_bytes(b"\1" * 10)
    elif damage == "deleted":
        weights.unlink()
    else:  # same size, other bytes: a later mtime (past the file system's timestamp granularity)
        time.sleep(0.05)
        weights.write_bytes(b"\2" * 64)
    built_once(base, _builder(calls))
    assert len(calls) == 2 and weights.read_bytes() == b"\1" * 64


def test_the_key_follows_the_code(cache, tmp_path_factory, tmp_path):
    code = tmp_path / "fixture_script.py"
    code.write_text("A = 1\n")
    first = fixture_root(tmp_path_factory, "demo", code)
    assert fixture_root(tmp_path_factory, "demo", code) == first
    code.write_text("A = 2\n")
    assert fixture_root(tmp_path_factory, "demo", code) != first
    assert fixture_root(tmp_path_factory, "other", code).name.startswith("other-")


def test_cold_builds_outside_the_cache(cache, tmp_path_factory, monkeypatch):
    monkeypatch.setenv("STREAMCK_COLD_FIXTURES", "1")
    root = fixture_root(tmp_path_factory, "demo", "tests/fixture_cache.py")
    assert cache not in root.parents and root.is_dir() and not any(root.iterdir())
    monkeypatch.setenv("STREAMCK_COLD_FIXTURES", "0")
    assert cache in fixture_root(tmp_path_factory, "demo", "tests/fixture_cache.py").parents


def test_two_processes_build_once(cache, tmp_path):
    """Two pytest processes wanting one entry at once: one builds, the other waits and uses it."""
    base = cache / "demo-key" / "demo"
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(HERE)!r})
        from pathlib import Path
        from fixture_cache import built_once
        def build(folder):
            with open({str(tmp_path / "builds")!r}, "a") as log:
                log.write("build\\n")
            time.sleep(1.5)
            (folder / "x").write_text("ok")
        print(built_once(Path({str(base)!r}), build))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0] and outs == [str(base)] * 2
    assert (tmp_path / "builds").read_text() == "build\n"
    assert (base / "x").read_text() == "ok"


def test_the_key_follows_the_installed_packages(tmp_path, monkeypatch):
    """Any installed version changed (here one more distribution on the path) is another key."""
    before = fixture_cache.installed.__wrapped__()
    assert len(before) == 64 and fixture_cache.installed.__wrapped__() == before
    assert any(f"torch-{torch_version()}.dist-info" in name for name in _names())
    (tmp_path / "torch-99.0.dist-info").mkdir()
    monkeypatch.syspath_prepend(tmp_path)
    assert fixture_cache.installed.__wrapped__() != before


def torch_version() -> str:
    import torch

    return torch.__version__


def _names() -> list[str]:
    return [p.name for entry in sys.path if Path(entry or ".").is_dir() for p in Path(entry or ".").glob("*.dist-info")]


def test_the_key_is_the_same_from_another_clone(tmp_path):
    """A clone elsewhere on the machine (its own .venv, the same versions) gets the same key."""
    code = "import fixture_cache; print(fixture_cache.installed())"
    here = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=HERE, check=True)
    clone = tmp_path / "clone"
    (clone / "tests").mkdir(parents=True)
    (clone / "tests" / "fixture_cache.py").write_bytes((HERE / "fixture_cache.py").read_bytes())
    (clone / ".venv").symlink_to(HERE.parent / ".venv")
    python = clone / ".venv" / "bin" / "python"  # its site-packages seen under the clone's path
    there = subprocess.run([python, "-c", code], capture_output=True, text=True, cwd=clone / "tests", check=True)
    assert here.stdout.strip() == there.stdout.strip() != ""


def test_unused_entries_of_that_fixture_are_pruned(cache, tmp_path_factory):
    """Building an entry removes the same fixture's entries unused for STALE_DAYS, no other's."""
    old = cache / "demo-0123456789abcdef"
    other = cache / "demo-other-0123456789abcdef"
    for d in (old, other):
        (d / "x").mkdir(parents=True)
        (d / ".used").touch()
        stale = time.time() - (fixture_cache.STALE_DAYS + 1) * 86400
        os.utime(d / ".used", (stale, stale))
    base = fixture_root(tmp_path_factory, "demo", "tests/fixture_cache.py") / "demo"
    built_once(base, _builder([]))
    assert not old.exists() and other.exists() and base.exists()
