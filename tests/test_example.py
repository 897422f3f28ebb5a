"""Issue #36: ./scripts/example, the README's first command, installs only what it runs
(streamck and its own dependencies), not the test tools ./scripts/test installs; it keeps
its work folder and shows the whole diff."""

import re
import shlex
import tomllib
from pathlib import Path

from helpers import fake_checkout

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


def test_the_example_prints_each_step_its_command_and_result(tmp_path):
    """Issue #54: what a user reads, not set -x traces: each step, its command, its result in a
    line; the diff's exit 1 shown as expected; at the end how to run the installed CLI."""
    import subprocess

    root = fake_checkout(tmp_path, "scripts/example", "bench/synth.py")
    env = {"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path), "HOME": str(tmp_path)}
    done = subprocess.run(["bash", root / "scripts" / "example"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert not [line for line in lines + done.stderr.splitlines() if line.startswith("+ ")]  # no traces
    steps = [i for i, line in enumerate(lines) if re.match(r"\[\d+\] ", line)]
    assert len(steps) == 8, done.stdout
    for i in steps:  # the command as typed, then a result line
        assert lines[i + 1].startswith("    $ "), lines[i : i + 3]
        assert any(line.startswith("    -> ") for line in lines[i + 2 : i + 4]), lines[i : i + 4]
    assert "    $ streamck diff $work/golden.json $work/out" in lines, done.stdout
    assert "    -> exit 1, as expected: the two differ; the report:" in lines
    assert any(line.strip().startswith("- model.layers.{0..") for line in lines), done.stdout  # the report, whole
    assert any(line.startswith("    -> exit 2, as expected: ") and "$work/broken.safetensors" in line for line in lines)
    assert lines[-3].startswith("streamck is installed in .venv: run it as .venv/bin/streamck")
    assert "source .venv/bin/activate" in lines[-2] and lines[-1].startswith("demo done")
