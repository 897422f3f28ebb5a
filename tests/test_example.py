"""Issue #36: ./scripts/example, the README's first command, installs only what it runs
(streamck and its own dependencies), not the test tools ./scripts/test installs; it keeps
its work folder and shows the whole diff."""

import re
import shlex
import tomllib
from pathlib import Path

import streamck

REPO = Path(streamck.__file__).resolve().parents[1]
# What ./scripts/test installs for the tests, never needed by the demo.
TEST_TOOLS = ("torch", "deepspeed", "ray", "transformers", "accelerate", "peft", "torchtitan", "megatron", "nemo")


def _installs(script: str) -> list[list[str]]:
    """The arguments of every ``pip install`` (scripts/test: ``uv_install``) in ``script``, continued lines joined."""
    joined, verb = script.replace("\\\n", " "), re.compile(r"pip install|uv_install ")
    return [shlex.split(verb.split(line, maxsplit=1)[1]) for line in joined.splitlines() if verb.search(line)]


def test_the_example_installs_only_streamck():
    installs = _installs((REPO / "scripts" / "example").read_text())
    assert installs, "the example installs streamck"
    packages = [a for args in installs for a in args if not a.startswith("-") or a == "-e"]
    assert packages == ["-e", "."] * len(installs), installs  # the checkout, no extras ('.[test]')
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    names = [re.match(r"[A-Za-z0-9_.-]+", d)[0].lower() for d in deps]
    assert not [n for n in names if n.startswith(TEST_TOOLS)], names


def test_the_check_reads_what_scripts_test_installs():
    """The control: the same reading finds the test tools in scripts/test."""
    installs = _installs((REPO / "scripts" / "test").read_text())
    assert any(".[test]" in args for args in installs)
    assert any(a.startswith("torch") for args in installs for a in args)


def test_the_example_keeps_its_work_folder_and_shows_the_whole_diff():
    script = (REPO / "scripts" / "example").read_text()
    assert "rm -rf" not in script and "trap" not in script
    assert "its files are in $work" in script
    diff = next(line for line in script.splitlines() if line.startswith("streamck diff"))
    assert "| head" not in diff
