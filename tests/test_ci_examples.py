"""Issue #43: the README's GitHub Actions workflow and GitLab job for a key-set check, their
commands run as written (the ``pip install`` line replaced by this checkout, which the suite's
Python already has) in a project holding a checkpoint and its golden manifest."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import yaml
from helpers import REPO, cli, save

JOBS = {".github/workflows/checkpoint-keys.yml": "github", ".gitlab-ci.yml": "gitlab"}


def _jobs() -> dict[str, list[str]]:
    """Each CI file docs/ci.md shows (a yaml block whose first line names it): its commands."""
    found = {}
    for block in re.findall(r"```yaml\n(.*?)```", (REPO / "docs" / "ci.md").read_text(), re.S):
        name = block.splitlines()[0].removeprefix("# ")
        if name in JOBS:
            doc = yaml.safe_load(block)
            if JOBS[name] == "github":
                found[name] = [s["run"] for job in doc["jobs"].values() for s in job["steps"] if "run" in s]
            else:
                found[name] = [line for job in doc.values() for line in job["script"]]
    return found


def test_readme_shows_both_jobs():
    jobs = _jobs()
    assert sorted(jobs) == sorted(JOBS)
    for commands in jobs.values():
        assert commands[0].startswith("pip install ") and "streamck" in commands[0]
        assert any(c.startswith("streamck diff ") for c in commands)


@pytest.mark.parametrize("name", sorted(JOBS))
def test_readme_ci_job_passes_then_fails_on_drift(name, tmp_path):
    commands = _jobs()[name]
    rng = np.random.default_rng(0)
    tensors = {f"model.layers.{i}.w": rng.standard_normal((4, 4)).astype(np.float32) for i in range(3)}
    save(tmp_path / "ckpt" / "model.safetensors", tensors)
    (tmp_path / "tests" / "golden").mkdir(parents=True)
    (tmp_path / "tests" / "golden" / "ckpt.keys.json").write_text(
        cli("ls", "--json", tmp_path / "ckpt", check=0).stdout
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}",
    }

    def job() -> subprocess.CompletedProcess:
        script = "set -e\n" + "\n".join(c for c in commands if not c.startswith("pip install "))
        return subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)

    passed = job()
    assert passed.returncode == 0, passed.stderr
    cli(
        "rewrite", tmp_path / "ckpt", "-o", tmp_path / "ckpt", "--force", "--dtype", "bf16", check=2
    )  # never the source
    cli("rewrite", tmp_path / "ckpt", "-o", tmp_path / "bf16", "--dtype", "bf16", check=0)
    os.replace(tmp_path / "bf16" / "model.safetensors", tmp_path / "ckpt" / "model.safetensors")
    drifted = job()
    assert drifted.returncode == 1
    assert "~ model.layers.{0..2}.w: F32 -> BF16" in drifted.stdout, drifted.stdout


# A placeholder a reader must fill in before the example works (<owner>, <a tag or commit>).
PLACEHOLDER = re.compile(r"<[^>\n]+>")


def test_ci_examples_hold_no_placeholders():
    """Issue #54: every yaml example in docs/ci.md works as written for a clone of streamck."""
    blocks = re.findall(r"```yaml\n(.*?)```", (REPO / "docs" / "ci.md").read_text(), re.S)
    assert len(blocks) == 3  # pre-commit, GitHub Actions, GitLab CI
    assert [PLACEHOLDER.findall(b) for b in blocks] == [[], [], []]


def test_precommit_example_names_a_clone_and_its_commit():
    """The pre-commit block: a local clone's path as ``repo`` (pre-commit fetches from any git
    remote git takes, a path included), a full commit as ``rev``, and this repository's hook id."""
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", (REPO / "docs" / "ci.md").read_text(), re.S)
                 if b.startswith("repos:"))  # fmt: skip
    (repo,) = yaml.safe_load(block)["repos"]
    assert repo["repo"].startswith("/") and re.fullmatch(r"[0-9a-f]{40}", repo["rev"]), repo
    hooks = {h["id"] for h in yaml.safe_load((REPO / ".pre-commit-hooks.yaml").read_text())}
    assert [h["id"] for h in repo["hooks"]] == ["streamck-diff"] and "streamck-diff" in hooks
    assert "rev-parse HEAD" in block


def test_ci_install_line_installs_streamck_from_a_clone_in_the_project(tmp_path):
    """The jobs' install line, run as written from a project holding a copy of this checkout at
    the path it names (no index reached: no dependencies, no build isolation), gives a streamck."""
    (line,) = {commands[0] for commands in _jobs().values()}
    args = line.split()
    assert args[:2] == ["pip", "install"] and len(args) == 3 and not args[2].startswith("-"), line
    clone = tmp_path / args[2]
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split("\0")  # fmt: skip
    for name in filter(None, files):
        if (REPO / name).is_file() and not name.startswith(("tests/", "bench/")):
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            (clone / name).write_bytes((REPO / name).read_bytes())
    site = tmp_path / "site"
    quiet = ["-q", "--no-deps", "--no-index", "--no-build-isolation", "--target", str(site)]
    subprocess.run([sys.executable, "-m", *args, *quiet], cwd=tmp_path, check=True, capture_output=True)
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run([sys.executable, "-m", "streamck", "--version"], cwd=tmp_path, env=env,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0 and done.stdout.startswith("streamck "), done.stderr
    assert (site / "streamck" / "__init__.py").exists()
