"""The README's Ray recipe for --part, run as written on a local Ray cluster (2 CPUs, 3
parts), gives a directory byte-identical to one run's."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
from helpers import REPO, save_sharded

import streamck

pytest.importorskip("ray", reason="ray (a test dependency, pyproject's [test]) is not installed")

_BLOCK = re.compile(r"Ray, one task per part.*?```python\n(.*?)```", re.S)
_PATHS = re.compile(r"^src, out, size, n = .*$", re.M)


def recipe() -> str:
    """The Ray block of docs/commands.md (once the README's), its indentation (it sits in a list item) removed."""
    block = _BLOCK.search((REPO / "docs" / "commands.md").read_text()).group(1)
    return "\n".join(line.removeprefix("  ") for line in block.splitlines())


def test_readme_ray_recipe_matches_one_run(tmp_path):
    rng = np.random.default_rng(0)
    want = {f"model.layers.{i}.w": rng.standard_normal((64, 64), dtype=np.float32) for i in range(6)}
    src = save_sharded(tmp_path / "src", want, 3)
    streamck.rewrite(src, tmp_path / "one", max_shard_size="20KB", dtype="bf16")
    code = recipe()
    assert _PATHS.search(code), "the recipe's paths line changed: update this test's substitution"
    paths = f"src, out, size, n = {str(src)!r}, {str(tmp_path / 'ray')!r}, '20KB', 3"
    script = (
        "import ray\n"
        "ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 << 20, log_to_driver=False)\n"
        + _PATHS.sub(lambda m: paths, code)
        + "\nray.shutdown()\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert len([n for n in one if n.endswith(".safetensors")]) == 3
    assert sorted(p.name for p in (tmp_path / "ray").iterdir()) == one
    for name in one:
        assert (tmp_path / "ray" / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name
