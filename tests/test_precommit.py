"""Issue #43: the pre-commit hook (``.pre-commit-hooks.yaml``), installed for real by pre-commit
from PyPI (scripts/test installs it) from a git repository of this checkout into a temp project
that holds a checkpoint and its golden manifest, as a team wires it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
from helpers import REPO, cli, save


def _git(cwd, *args) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}  # fmt: skip
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout


def _this_checkout(dest) -> str:
    """A git repository of this checkout as it is now (uncommitted changes included), and its commit."""
    files = _git(REPO, "ls-files", "-z", "--cached", "--others", "--exclude-standard").split("\0")
    for name in filter(None, files):
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    _git(dest, "init", "-q")
    _git(dest, "add", "-A")
    _git(dest, "commit", "-qm", "streamck")
    return _git(dest, "rev-parse", "HEAD").strip()


def test_precommit_hook_passes_then_names_a_renamed_tensor(tmp_path):
    hook_repo = tmp_path / "streamck"
    rev = _this_checkout(hook_repo)
    project = tmp_path / "project"
    rng = np.random.default_rng(0)
    save(project / "ckpt" / "model.safetensors", {f"layers.{i}.w": rng.standard_normal((4, 4)) for i in range(3)})
    (project / "golden").mkdir()
    (project / "golden" / "ckpt.keys.json").write_text(cli("ls", "--json", project / "ckpt", check=0).stdout)
    (project / ".pre-commit-config.yaml").write_text(
        f"repos:\n  - repo: {hook_repo.as_uri()}\n    rev: {rev}\n    hooks:\n      - id: streamck-diff\n"
        "        args: [golden/ckpt.keys.json, ckpt]\n"
    )
    _git(project, "init", "-q")
    _git(project, "add", "-A")
    env = {**os.environ, "PRE_COMMIT_HOME": str(tmp_path / "pc-home"), "PYTHONPATH": ""}

    def run():
        command = ["timeout", "600", sys.executable, "-m", "pre_commit", "run", "--all-files"]
        return subprocess.run(command, cwd=project, env=env, capture_output=True, text=True)

    first = run()
    assert first.returncode == 0, first.stdout + first.stderr
    assert "streamck diff" in first.stdout and "Passed" in first.stdout
    cli("rewrite", project / "ckpt", "-o", tmp_path / "renamed", "--rename", "layers.1.w=layers.1.weight", check=0)
    shutil.copy(tmp_path / "renamed" / "model.safetensors", project / "ckpt" / "model.safetensors")
    second = run()
    assert second.returncode == 1 and "Failed" in second.stdout
    assert "- layers.1.w" in second.stdout and "+ layers.1.weight" in second.stdout, second.stdout
