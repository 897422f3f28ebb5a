"""--merge-engine numpy (the engine without torch) against PEFT's merge: equal on the small
bases, and at high rank all but a few values (numpy's GEMM and norm sum in another order)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import REPO, cli
from lora_fixtures import CASES
from test_lora import load_dir, lora_cases  # noqa: F401  (the session fixture)

from streamck import write_plan
from streamck.api import build_plan

pytest.importorskip("peft")


def ordered(t: torch.Tensor) -> np.ndarray:
    """A 16-bit float's bits as integers that count ulps across zero."""
    u = t.contiguous().view(torch.int16).numpy().astype(np.int32) & 0xFFFF
    return np.where(u & 0x8000, -(u & 0x7FFF), u)


def ulps(got_dir, want_dir) -> tuple[int, float]:
    """The largest distance in ulps over every tensor, and the share of values that are equal."""
    got, want = load_dir(got_dir), load_dir(want_dir)
    assert sorted(got) == sorted(want)
    worst, equal, total = 0, 0, 0
    for k, w in want.items():
        assert got[k].dtype == w.dtype == torch.bfloat16, k
        d = np.abs(ordered(got[k]) - ordered(w))
        worst, equal, total = max(worst, int(d.max())), equal + int((d == 0).sum()), total + d.size
    return worst, equal / total


@pytest.mark.parametrize("name", sorted(CASES))
def test_numpy_merge_on_small_bases(lora_cases, name, tmp_path):  # noqa: F811
    case = lora_cases(name)
    plan = build_plan(
        case["base"], merge_lora=case["adapter"], safe_merge=case.get("safe_merge", False), merge_engine="numpy"
    )
    assert any("numpy fp32" in line for line in plan.summary)
    write_plan(plan, tmp_path / "out", chunk=4096)
    worst, share = ulps(tmp_path / "out", case["oracle"])
    assert worst <= 8 and share > 0.99, (worst, share)  # equal on this machine; BLAS kernels vary


def test_without_torch_numpy_merges(lora_cases, tmp_path):  # noqa: F811
    """With torch missing, the merge runs in numpy and says so on stderr."""
    case = lora_cases("plain")
    fake = tmp_path / "no-torch" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n")
    env = {"PYTHONPATH": f"{fake.parent}:{REPO}"}
    proc = cli("rewrite", case["base"], "-o", tmp_path / "out", "--merge-lora", case["adapter"], env=env, check=0)
    assert "note: torch is not installed: merging with numpy" in proc.stderr
    worst, share = ulps(tmp_path / "out", case["oracle"])
    assert worst <= 8 and share > 0.99, (worst, share)  # equal on this machine; BLAS kernels vary
    proc = cli(
        "rewrite",
        case["base"],
        "-o",
        tmp_path / "o2",
        "--merge-lora",
        case["adapter"],
        "--merge-engine",
        "torch",
        env=env,
        check=2,
    )
    assert "torch is not installed" in proc.stderr and not (tmp_path / "o2").exists()


@pytest.mark.parametrize("r", [64, 256])
def test_numpy_at_high_rank(tmp_path, r):
    """Where numpy's GEMM sums otherwise than torch's: at r = 256 here 0.01% of the values differ,
    by up to 4 units in the last place."""
    from lora_fixtures import make_adapter, make_base, peft_merge

    options = {"hidden_size": 256, "intermediate_size": 700, "vocab_size": 1000, "num_hidden_layers": 1}
    base = make_base(tmp_path / "base", **options)
    adapter = make_adapter(base, tmp_path / "adapter", r=r, lora_alpha=2 * r)
    want = peft_merge(base, adapter, tmp_path / "peft")
    write_plan(build_plan(base, merge_lora=adapter, merge_engine="numpy"), tmp_path / "out", chunk=4096)
    worst, share = ulps(tmp_path / "out", want)
    assert worst <= 8 and share > 0.999, (worst, share)
