"""--merge-lora's memory is bounded by a block, not a tensor: a child merges an adapter into a
base whose MLP weights are 128 MiB each (256 MiB in fp32), and its peak RSS stays within a
few blocks of what importing torch alone costs."""

from __future__ import annotations

import subprocess
import sys

import pytest
from lora_fixtures import make_adapter, make_base

pytest.importorskip("peft")

CHILD = """
import sys
import torch
if sys.argv[1] != "baseline":
    from streamck import write_plan
    from streamck.api import build_plan
    write_plan(build_plan(sys.argv[2], merge_lora=sys.argv[3]), sys.argv[4])
print(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")))
"""


def _peak(*args: str) -> float:
    # VmHWM of the child's own image (see tests/test_memory.py for why not ru_maxrss)
    child = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True)
    assert child.returncode == 0, child.stderr
    return int(child.stdout.split()[-1]) / 1024


def test_merge_memory_is_a_block_not_a_tensor(tmp_path):
    base = make_base(tmp_path / "base", hidden_size=1024, intermediate_size=65536, num_hidden_layers=1)
    adapter = make_adapter(base, tmp_path / "adapter", target_modules=["up_proj", "down_proj", "q_proj"])
    torch_only = _peak("baseline")
    merged = _peak("merge", str(base), str(adapter), str(tmp_path / "out"))
    assert merged - torch_only < 48, (torch_only, merged)  # 27 MiB here; 67 with 16 MiB blocks
