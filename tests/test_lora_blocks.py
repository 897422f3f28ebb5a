"""The merge's row blocks give the whole-tensor bits: torch's CPU GEMM (and DoRA's row norm)
sum each element in the same order for every block streamck.transforms.lora.row_blocks makes,
for ranks up to 256; and end to end against PEFT on a wider base at r = 64, 128 and 256."""

from __future__ import annotations

import pytest
import torch
from lora_fixtures import make_adapter, make_base, peft_merge
from test_lora import assert_same

import streamck.transforms.lora
from streamck import write_plan
from streamck.api import build_plan
from streamck.transforms.lora import BLOCK_ROWS, row_blocks
from streamck.transforms.lora_torch import one_thread

RANKS = (8, 16, 32, 64, 128, 256)
# (rows, cols): multiples of 16, a tail of 1 (4097: alone, a block of 1 row sums differently), odd sizes.
SHAPES = ((64, 64), (333, 128), (4097, 96), (1025, 333), (130, 7), (31, 64))


def test_blocks_are_whole_multiples():
    for rows in range(1, 300):
        blocks = row_blocks(rows, 64, 16 * 64)
        sizes = [b - a for a, b in blocks]
        assert blocks[0][0] == 0 and blocks[-1][1] == rows
        assert all(s % BLOCK_ROWS == 0 for s in sizes[:-1]) and (sizes[-1] >= BLOCK_ROWS or len(sizes) == 1)


@pytest.mark.parametrize("r", RANKS)
def test_row_blocked_gemm_is_the_whole_gemm(r):
    torch.manual_seed(r)
    for rows, cols in SHAPES:
        a, b = torch.randn(r, cols), torch.randn(rows, r) * 0.02
        whole, whole_t = (b @ a) * 0.75, (b @ a).T * 0.75  # as PEFT computes them, on torch's threads
        with one_thread():  # as the merge computes them
            for chunk in (1, 64 * cols * 4, 1000 * cols):
                parts = torch.cat([(b[s:e] @ a) * 0.75 for s, e in row_blocks(rows, cols * 4, chunk)])
                assert torch.equal(parts, whole), (rows, cols, chunk)
            # an embedding's delta, (B @ A)^T, in blocks of A's columns
            parts = torch.cat([(b @ a[:, s:e]).T * 0.75 for s, e in row_blocks(cols, rows * 4, 1)])
            assert torch.equal(parts, whole_t), (rows, cols)


def test_row_blocked_norm_is_the_whole_norm():
    torch.manual_seed(0)
    for rows, cols in SHAPES:
        s = torch.randn(rows, cols)
        whole = torch.linalg.norm(s, dim=1)
        with one_thread():
            parts = torch.cat([torch.linalg.norm(s[a:b], dim=1) for a, b in row_blocks(rows, cols * 4, 1)])
        assert torch.equal(parts, whole)


@pytest.fixture(scope="module")
def wide_base(tmp_path_factory):
    """hidden 256, MLP 700 rows (a tail of 12), vocab 1000: every tensor in several blocks."""
    options = {"hidden_size": 256, "intermediate_size": 700, "vocab_size": 1000, "num_hidden_layers": 1}
    return make_base(tmp_path_factory.mktemp("wide") / "base", **options)


@pytest.mark.parametrize(("r", "dora"), [(64, False), (128, True), (256, False)])
def test_high_rank_against_peft(wide_base, tmp_path, monkeypatch, r, dora):
    adapter = make_adapter(wide_base, tmp_path / "adapter", r=r, lora_alpha=2 * r, use_dora=dora)
    want = peft_merge(wide_base, adapter, tmp_path / "peft")
    monkeypatch.setattr(streamck.transforms.lora, "MERGE_CHUNK", 4096)  # every tensor in several blocks
    write_plan(build_plan(wide_base, merge_lora=adapter), tmp_path / "out")
    assert_same(tmp_path / "out", want)
