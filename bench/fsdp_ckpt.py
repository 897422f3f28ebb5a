"""A Trainer + FSDP2 SHARDED_STATE_DICT checkpoint of a given size, on 2 gloo ranks.

    python bench/fsdp_ckpt.py DIR --size 2GiB

Writes ``DIR/checkpoint-1/pytorch_model_fsdp_0/`` as accelerate's ``save_fsdp_model`` does
(``dist_cp.save({"model": state_dict}, FileSystemWriter, DefaultSavePlanner)``, the state
dict from ``get_model_state_dict``) for a Llama (transformers, built from a config on the
meta device) sharded with FSDP2's ``fully_shard`` per decoder layer and at the root, then
materialised on CPU (``to_empty``): each rank holds only its shards, filled with random
values. F32, untied head. Standalone: nothing here imports streamck or the tests.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

WORLD = 2


def config(size: int):
    """A Llama config of about ``size`` bytes in F32 (at least one layer); toy dimensions
    below 256 MiB, so the harness test stays small."""
    from transformers import LlamaConfig

    hidden, inter, vocab = (1024, 2816, 32000) if size >= 256 << 20 else (64, 176, 1024)
    layer = 4 * (4 * hidden * hidden + 3 * hidden * inter)
    layers = max(1, (size - 4 * 2 * vocab * hidden) // layer)
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=16 if hidden >= 1024 else 4,
        num_key_value_heads=16 if hidden >= 1024 else 4,
        tie_word_embeddings=False,
    )


def _worker(rank: int, root: str, size: int, store_path: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dist_cp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(config(size))
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        model.to_empty(device="cpu")
        gen = torch.Generator().manual_seed(rank)
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().normal_(generator=gen)
        ckpt = Path(root) / "checkpoint-1" / "pytorch_model_fsdp_0"
        ckpt.mkdir(parents=True, exist_ok=True)
        state = get_model_state_dict(model)
        dist_cp.save(state_dict={"model": state}, storage_writer=dist_cp.FileSystemWriter(str(ckpt)),
                     planner=DefaultSavePlanner())  # fmt: skip
        dist.barrier()
    finally:
        dist.destroy_process_group()


def make_fsdp(root: Path, size: int) -> Path:
    """Write the checkpoint under ``root`` (see the module doc); return ``root/checkpoint-1``."""
    import torch.multiprocessing as mp

    root.mkdir(parents=True, exist_ok=True)
    store = root / "filestore"
    store.unlink(missing_ok=True)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        mp.start_processes(_worker, args=(str(root), size, str(store)), nprocs=WORLD, start_method="spawn")
    finally:
        store.unlink(missing_ok=True)
    os.sync()
    return root / "checkpoint-1"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=Path)
    p.add_argument("--size", default="2GiB")
    a = p.parse_args()
    from streamck.writer import parse_size

    ck = make_fsdp(a.dir, parse_size(a.size))
    files = list((ck / "pytorch_model_fsdp_0").iterdir())
    print(ck, sum(f.stat().st_size for f in files), file=sys.stderr)


if __name__ == "__main__":
    main()
