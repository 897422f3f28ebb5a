"""streamck.source.zero.read against real DeepSpeed checkpoints and zero_to_fp32's own output.

Each entry is assembled here from its tiles alone (numpy, file reads) and compared with
``get_fp32_state_dict_from_zero_checkpoint``; frozen params and buffers also with the
module's own values, and trainable params with those gathered from the live engine.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed  # noqa: F401  a test dependency: missing, the suite fails rather than skips
import torch
import zero_fixtures

from streamck.errors import CheckpointError
from streamck.source.zero.find import find_zero
from streamck.source.zero.read import read_zero

CASES = [c["name"] for c in zero_fixtures.cases()]
NP = {"F32": np.float32, "F64": np.float64, "F16": np.float16, "BF16": np.uint16, "I64": np.int64, "I32": np.int32}
TORCH = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64}


def assemble(entry) -> np.ndarray:
    """The tensor from its tiles alone: 1-D tiles over the flattened elements."""
    dt = np.dtype(NP[entry.dtype])
    n = int(np.prod(entry.shape, dtype=np.int64))
    flat = np.zeros(n, dt)
    seen = np.zeros(n, np.int8)
    for t in entry.tiles:
        assert len(t.offsets) == len(t.sizes) == 1
        (o,), (m,) = t.offsets, t.sizes
        with open(t.path, "rb") as f:
            f.seek(t.start)
            raw = f.read(m * dt.itemsize)
        assert len(raw) == m * dt.itemsize, "tile runs past the end of its file"
        flat[o : o + m] = np.frombuffer(raw, dt)
        seen[o : o + m] += 1
    assert (seen == 1).all(), "tiles do not cover the tensor exactly once"
    if entry.dtype == "BF16":
        flat = (flat.astype(np.uint32) << 16).view(np.float32)
    return flat.reshape(entry.shape)


def as_np(t) -> np.ndarray:
    t = t.detach()
    return (t.float() if t.dtype in (torch.bfloat16, torch.float16) else t).contiguous().numpy()


@pytest.mark.parametrize("name", CASES)
def test_matches_zero_to_fp32(zero_cases, name):
    case = zero_cases[name]
    step = find_zero(case["checkpoint"])
    assert step == case["step_dir"]
    assert find_zero(case["step_dir"]) == case["step_dir"]
    entries, _, notices = read_zero(step)
    oracle = torch.load(case["oracle"], weights_only=True)
    module = torch.load(case["module"], weights_only=True)
    trained = torch.load(case["trained"], weights_only=True)
    low = torch.bfloat16 if case["dtype"] == "bf16" else torch.float32

    assert set(entries) == set(zero_fixtures.PARAM_NAMES) | set(zero_fixtures.BUFFERS)
    assert all(e.name == n for n, e in entries.items())
    if case["stage"] == 1:  # zero_to_fp32 leaves ZeRO-1 frozen params out
        assert set(entries) - set(oracle) == set(zero_fixtures.FROZEN)
        assert any("frozen params" in line for line in notices)
    else:
        assert not notices
    assert [n for n in entries if n in oracle] == list(oracle), "zero_to_fp32's order"

    for n, e in entries.items():
        got = assemble(e)
        assert got.shape == tuple(e.shape)
        if n in oracle:
            assert tuple(oracle[n].shape) == tuple(e.shape), n
            np.testing.assert_array_equal(got, as_np(oracle[n]), err_msg=n)
        if n in zero_fixtures.BUFFERS:
            assert e.dtype == {"scale": "F32", "pos": "I64"}[n]
            np.testing.assert_array_equal(got, as_np(module[n]), err_msg=n)
        elif n in zero_fixtures.FROZEN:
            assert e.dtype == ("BF16" if low is torch.bfloat16 else "F32"), n
            np.testing.assert_array_equal(got, as_np(module[n].to(low)), err_msg=n)
        else:
            assert e.dtype == "F32", n  # the fp32 master weights, in bf16 runs too
            live = torch.from_numpy(got.copy()).to(low).float().numpy()
            np.testing.assert_array_equal(live, as_np(trained[n if n in trained else "embed.weight"]), err_msg=n)
    assert entries["lm_head.weight"].tiles == entries["embed.weight"].tiles  # tied: both names written


# ---- refusals, on mutated copies ----


def _copy(zero_cases, name, tmp_path) -> Path:
    dst = tmp_path / "global_step1"
    shutil.copytree(zero_cases[name]["step_dir"], dst)
    return dst


def _rewrite(path: Path, edit) -> None:
    obj = torch.load(path, weights_only=False)
    edit(obj)
    torch.save(obj, path)


def _refused(step: Path, *words: str) -> str:
    with pytest.raises(CheckpointError) as e:
        read_zero(step)
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg
    return msg


@pytest.mark.parametrize("name", ["z2_w3_fp32", "z3_w3_bf16", "z1_w2_fp32"])
def test_missing_rank_file(zero_cases, tmp_path, name):
    step = _copy(zero_cases, name, tmp_path)
    victim = next(p for p in step.iterdir() if "rank_1_" in p.name and p.name.endswith("optim_states.pt"))
    victim.unlink()
    _refused(step, "rank 1", "missing")


def test_missing_zero3_model_states(zero_cases, tmp_path):
    step = _copy(zero_cases, "z3_w2_fp32", tmp_path)
    (step / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    _refused(step, "zero_pp_rank_1_mp_rank_00_model_states.pt", "missing")


def test_extra_rank_file(zero_cases, tmp_path):
    step = _copy(zero_cases, "z2_w2_fp32", tmp_path)
    shutil.copy(step / "zero_pp_rank_0_mp_rank_00_optim_states.pt", step / "zero_pp_rank_2_mp_rank_00_optim_states.pt")
    _refused(step, "3 optimizer rank files", "world size of 2")
    (step / "zero_pp_rank_2_mp_rank_00_optim_states.pt").unlink()
    shutil.copy(
        step / "zero_pp_rank_1_mp_rank_00_optim_states.pt", step / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    )
    _refused(step, "two optimizer files for rank 1")


@pytest.mark.parametrize("file", ["layer_0_expert_0_mp_rank_00_model_states.pt", "expert_3_mp_rank_00_model_states.pt"])
def test_moe_refused(zero_cases, tmp_path, file):
    step = _copy(zero_cases, "z2_w2_bf16", tmp_path)
    shutil.copy(step / "mp_rank_00_model_states.pt", step / file)
    _refused(step, "MoE expert files", file)


def test_autoep_refused(zero_cases, tmp_path):
    step = _copy(zero_cases, "z3_w2_fp32", tmp_path)
    _rewrite(step / "zero_pp_rank_1_mp_rank_00_model_states.pt", lambda sd: sd.update(ds_autoep_layers=[{"x": 1}]))
    _refused(step, "AutoEP")


def test_zero3_expert_groups_refused(zero_cases, tmp_path):
    step = _copy(zero_cases, "z3_w2_fp32", tmp_path)
    edit = lambda sd: sd["optimizer_state_dict"].update(ds_zero_partition_groups=[{"x": 1}])  # noqa: E731
    _rewrite(step / "zero_pp_rank_0_mp_rank_00_optim_states.pt", edit)
    _refused(step, "AutoEP")


def test_expert_partition_counts_refused(zero_cases, tmp_path):
    step = _copy(zero_cases, "z2_w2_fp32", tmp_path)
    _rewrite(
        step / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        lambda sd: sd["optimizer_state_dict"].update(partition_count=[2, 1]),
    )
    _refused(step, "different world sizes")


def test_nvme_offload_refused(zero_cases, tmp_path):
    step = _copy(zero_cases, "z3_w2_bf16", tmp_path)

    def empty_group(sd):
        sd["optimizer_state_dict"]["fp32_flat_groups"][1] = torch.empty(0)

    _rewrite(step / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", empty_group)
    _refused(step, "NVMe")


def test_zero3_count_mismatch(zero_cases, tmp_path):
    step = _copy(zero_cases, "z3_w3_fp32", tmp_path)
    for r in range(3):
        _rewrite(
            step / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt", lambda sd: sd["param_shapes"][1].pop("head.weight")
        )
    _refused(step, "param_shapes use", "fp32_flat_groups hold")


def test_zero3_group_sizes_differ(zero_cases, tmp_path):
    step = _copy(zero_cases, "z3_w2_fp32", tmp_path)

    def shorten(sd):
        g = sd["optimizer_state_dict"]["fp32_flat_groups"]
        g[0] = g[0][:-1].clone()

    _rewrite(step / "zero_pp_rank_1_mp_rank_00_optim_states.pt", shorten)
    _refused(step, "sizes differ")


def test_zero2_count_mismatch(zero_cases, tmp_path):
    step = _copy(zero_cases, "z2_w3_fp32", tmp_path)

    def drop(sd):
        sd["param_shapes"][0].pop("head.weight")

    _rewrite(step / "mp_rank_00_model_states.pt", drop)
    _refused(step, "param_alignment_paddings")

    def drop_pad(sd):
        sd["optimizer_state_dict"]["param_alignment_paddings"][0].pop()

    _rewrite(step / "zero_pp_rank_0_mp_rank_00_optim_states.pt", drop_pad)
    _refused(step, "params use", "elements")


def test_zero2_group_count_mismatch(zero_cases, tmp_path):
    step = _copy(zero_cases, "z1_w2_fp32", tmp_path)
    _rewrite(step / "mp_rank_00_model_states.pt", lambda sd: sd["param_shapes"].append({"extra.weight": (3,)}))
    _refused(step, "3 param groups in param_shapes, 2 in the optimizer state")


def test_tensor_parallel_refused(zero_cases, tmp_path):
    step = _copy(zero_cases, "z2_w1_fp32", tmp_path)
    shutil.copy(step / "zero_pp_rank_0_mp_rank_00_optim_states.pt", step / "zero_pp_rank_0_mp_rank_01_optim_states.pt")
    _refused(step, "tensor-parallel")


def test_pickle_with_code_refused(zero_cases, tmp_path):
    step = _copy(zero_cases, "z2_w2_fp32", tmp_path)
    _rewrite(step / "mp_rank_00_model_states.pt", lambda sd: sd.update(evil=os.system))
    _refused(step, "refusing to load", "system")


class _Huge:
    def __reduce__(self):
        return bytes, (1 << 40,)  # a TiB, if the call were made


def test_plain_types_in_client_state_are_never_called(zero_cases, tmp_path):
    """OmegaConf names plain types (``object_type``); the pickle gets stand-ins, so no call
    to them can allocate (a real ``bytes`` would try for a TiB here)."""
    step = _copy(zero_cases, "z2_w2_fp32", tmp_path)
    _rewrite(step / "mp_rank_00_model_states.pt", lambda sd: sd.update(huge=_Huge(), kind=dict))
    entries, _, _ = read_zero(step)
    assert entries


def test_find_zero(zero_cases, tmp_path):
    case = zero_cases["z3_w2_bf16"]
    assert find_zero(case["checkpoint"]) == case["step_dir"]
    assert find_zero(case["dir"]) is None
    assert find_zero(tmp_path / "nope") is None
    ck = tmp_path / "checkpoint-7"
    ck.mkdir()
    (ck / "latest").write_text("global_step7\n")
    with pytest.raises(CheckpointError, match="global_step7"):
        find_zero(ck)
