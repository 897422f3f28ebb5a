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
    """Each CI file the README shows (a yaml block whose first line names it): its commands."""
    found = {}
    for block in re.findall(r"```yaml\n(.*?)```", (REPO / "README.md").read_text(), re.S):
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
