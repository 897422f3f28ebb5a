"""Checkpoints written by Megatron-LM's own training loop (bench/megatron_loop.py: ``pretrain`` from the
megatron-core 0.19.2 wheel as ``pretrain_gpt.py`` runs it), one step each, ``--ckpt-format torch_dist``,
mock data, CPU/gloo; the device plumbing it took is in that module.

``torchrun --nproc-per-node 4 tests/megatron_train_fixtures.py ROOT`` runs each of RUNS in turn in
one launch (four ranks: a PP=2 run is data parallel 2 beside it). Every run is Llama-style (RMSNorm,
SwiGLU, RoPE, GQA, the vocabulary padded past the tokenizer's: megatron_loop.COMMON).

Then the oracle, ``ROOT/<run>/oracle.pt``: the run's flags at TP=1/PP=1, megatron-core's own
``dist_checkpointing.load`` of the saved iteration into that model, and its fp32 forward on fixed
tokens (the logits up to the tokenizer's vocabulary).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from megatron_ckpt import fixed_tokens, forward
from megatron_loop import COMMON, ITERATION, VOCAB, load_whole, reset, start, train

__all__ = ["COMMON", "RUNS", "VOCAB"]

RUNS = {
    "pp2": "--pipeline-model-parallel-size 2 --untie-embeddings-and-output-weights",
    "pp2_tied": "--pipeline-model-parallel-size 2",
    "pp2_uneven": "--pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 1 "
    "--untie-embeddings-and-output-weights",
    "tp2_pp2": "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --untie-embeddings-and-output-weights",
    "moe_pp2": "--pipeline-model-parallel-size 2 --expert-model-parallel-size 2 --num-experts 4 "
    "--moe-ffn-hidden-size 32 --moe-router-topk 2 --moe-token-dispatcher-type allgather "
    "--moe-router-load-balancing-type none --untie-embeddings-and-output-weights",
}


def oracle(name: str, root: Path) -> None:
    """RUNS[name] loaded whole (megatron_loop.load_whole), its fp32 forward on the fixed tokens of the other
    megatron fixtures (bench/megatron_ckpt.py) saved as ``oracle.pt``."""
    import torch
    import torch.distributed as dist

    model = load_whole(RUNS[name].split(), root / name / f"iter_{ITERATION:07d}")
    tokens = fixed_tokens(VOCAB)
    with torch.no_grad():
        logits = forward(model, tokens)
    if dist.get_rank() == 0:
        torch.save({"tokens": tokens, "logits": logits[..., :VOCAB].float()}, root / name / "oracle.pt")
    reset()


def main(root: Path, names: list[str]) -> None:
    import torch.distributed as dist

    start()
    for name in names:
        train(RUNS[name].split(), root / name)
        dist.barrier()
    for name in names:
        oracle(name, root)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    main(Path(sys.argv[1]), sys.argv[2:] or list(RUNS))
