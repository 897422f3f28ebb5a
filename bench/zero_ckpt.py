"""A DeepSpeed ZeRO-3 checkpoint with fp32 master weights of a given size, written by DeepSpeed.

    python bench/zero_ckpt.py DIR --size 1GiB          # trains one step on 2 CPU ranks (gloo)

DeepSpeed itself trains a Llama-shaped model one AdamW step (fp32, ZeRO-3, 2 ranks, CPU
accelerator, params built partitioned under ``deepspeed.zero.Init``) and saves it in the
HF-Trainer layout ``DIR/checkpoint-1/{latest, zero_to_fp32.py, global_step1/…}``:
per rank ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` and
``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` (fp32 master partition + both Adam
moments: the step directory is ~3× the fp32 weights). The embedding (about ``size / 8``,
at most 256 MiB) is tied to ``lm_head`` (a ``shared_params`` alias); one layer norm is frozen.

Nothing is scaled or rewritten by hand: every byte is DeepSpeed's. Standalone: nothing here
imports streamck or the tests.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path

from streamck.writer import parse_size

WORLD = 2
MiB = 1 << 20


def dims(size: int) -> tuple[int, int, int, int]:
    """(vocab, hidden, intermediate, layers) for about ``size`` bytes of fp32 params."""
    hidden = 2048 if size >= 1 << 30 else (512 if size >= 64 * MiB else 64)
    inter = hidden * 11 // 4
    vocab = max(3, min(size // 8, 256 * MiB) // (hidden * 4)) | 1  # odd: no world size divides it
    per_layer = (2 * hidden * hidden + 2 * (hidden // 4) * hidden + 3 * inter * hidden + 2 * hidden) * 4
    layers = max(1, -(-(size - (vocab + 1) * hidden * 4) // per_layer))
    return vocab, hidden, inter, layers


def weight_bytes(size: int) -> int:
    """The fp32 weights of the model of ``dims(size)`` (the tied lm_head counted once)."""
    vocab, hidden, inter, layers = dims(size)
    per_layer = 2 * hidden * hidden + 2 * (hidden // 4) * hidden + 3 * inter * hidden + 2 * hidden
    return (vocab * hidden + layers * per_layer + hidden) * 4


def _model(vocab: int, hidden: int, inter: int, layers: int):
    import torch
    from torch import nn

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = nn.Linear(hidden, hidden, bias=False)
            self.k_proj = nn.Linear(hidden, hidden // 4, bias=False)
            self.v_proj = nn.Linear(hidden, hidden // 4, bias=False)
            self.o_proj = nn.Linear(hidden, hidden, bias=False)
            self.gate_proj = nn.Linear(hidden, inter, bias=False)
            self.up_proj = nn.Linear(hidden, inter, bias=False)
            self.down_proj = nn.Linear(inter, hidden, bias=False)
            self.input_layernorm = nn.LayerNorm(hidden, bias=False)
            self.post_attention_layernorm = nn.LayerNorm(hidden, bias=False)

        def forward(self, h):
            x = self.input_layernorm(h)
            kv = self.k_proj(x).sum(-1, keepdim=True) + self.v_proj(x).sum(-1, keepdim=True)
            h = h + self.o_proj(self.q_proj(x)) * torch.sigmoid(kv)
            x = self.post_attention_layernorm(h)
            return h + self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(vocab, hidden)
            self.layers = nn.ModuleList(Layer() for _ in range(layers))
            self.norm = nn.LayerNorm(hidden, bias=False)
            self.lm_head = nn.Linear(hidden, vocab, bias=False)
            self.lm_head.weight = self.embed_tokens.weight  # tied: a shared_params alias
            self.register_buffer("inv_freq", torch.linspace(0.0, 1.0, hidden // 32))
            self.layers[0].input_layernorm.weight.requires_grad_(False)  # a frozen param

        def forward(self, ids):
            h = self.embed_tokens(ids)
            for layer in self.layers:
                h = layer(h)
            return self.lm_head(self.norm(h))

    return Net()


def _worker(rank: int, port: int, out: str, shape: tuple[int, int, int, int]) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_SIZE=str(WORLD),
        DS_ACCELERATOR="cpu",
    )
    import logging

    import deepspeed
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "reduce_bucket_size": 2**24,  # elements; the 5e8 default allocates GiBs per rank
            "stage3_prefetch_bucket_size": 2**24,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = _model(*shape)
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=config)
    ids = torch.randint(0, shape[0], (1, 4), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(ids).float().pow(2).mean())
    engine.step()
    engine.save_checkpoint(str(Path(out) / "checkpoint-1"), tag="global_step1")
    dist.barrier()
    engine.destroy()
    dist.destroy_process_group()


def _drop_shm(port: int) -> None:
    """DeepSpeed's CPU all-reduce leaves its shared-memory buffers in /dev/shm (GiBs over a
    test session): remove this run's, named by its port."""
    for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
        path.unlink(missing_ok=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_zero(root: Path, size: int) -> Path:
    """Train and save under ``root``; return ``root/checkpoint-1``."""
    import torch.multiprocessing as mp

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    os.environ["DS_ACCELERATOR"] = "cpu"
    port = _free_port()
    try:
        mp.start_processes(_worker, args=(port, str(root), dims(size)), nprocs=WORLD, start_method="spawn")
    finally:
        _drop_shm(port)
    os.sync()
    return root / "checkpoint-1"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=Path)
    p.add_argument("--size", default="1GiB")
    a = p.parse_args()
    t0 = time.time()
    ck = make_zero(a.dir, parse_size(a.size))
    step = ck / "global_step1"
    total = sum(f.stat().st_size for f in step.iterdir())
    print(
        f"wrote {ck} ({dims(parse_size(a.size))}), step dir {total / 2**30:.2f} GiB, {time.time() - t0:.0f} s",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
