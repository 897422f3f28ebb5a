"""An FSDP2 ``dcp.save`` of a transformers-5 Qwen3-MoE model, on 2 gloo ranks, and the route
users take today to per-expert Hugging Face files.

    python bench/moe_ckpt.py DIR --experts 16        # the checkpoint, config.json beside
    python bench/moe_ckpt.py route SRC OUT           # dcp_to_torch_save + load_state_dict + save_pretrained

The model (2 layers, hidden 2048, experts of hidden 2048, vocabulary 16384, F32) is built on
the meta device, sharded with ``fully_shard`` per decoder layer and at the root, materialised
on CPU (``to_empty``) and filled with random values per rank; ``dcp.save(model.state_dict())``
writes each fused ``experts.gate_up_proj`` [E, 4096, 2048] (E × 32 MiB) and ``experts.down_proj``
[E, 2048, 2048] (E × 16 MiB) as one chunk per rank. ``route`` is the conversion users run: torch's
``dcp_to_torch_save`` to one ``.pt``, ``torch.load``, the model built from the config and
``load_state_dict(assign=True)``, then ``save_pretrained`` (per-expert names). Standalone:
nothing here imports streamck.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

WORLD = 2
HIDDEN, EXPERT_HIDDEN, VOCAB, LAYERS = 2048, 2048, 16384, 2


def config(experts: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4096, moe_intermediate_size=EXPERT_HIDDEN,
        num_experts=experts, num_experts_per_tok=2, num_hidden_layers=LAYERS, num_attention_heads=16,
        num_key_value_heads=4, head_dim=128, tie_word_embeddings=False,
    )  # fmt: skip


def _worker(rank: int, root: str, experts: int, store_path: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen3MoeForCausalLM

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    try:
        with torch.device("meta"):
            model = Qwen3MoeForCausalLM(config(experts))
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        model.to_empty(device="cpu")
        gen = torch.Generator().manual_seed(rank)
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().normal_(generator=gen)
        dcp.save(model.state_dict(), checkpoint_id=root)
        if rank == 0:
            model.config.save_pretrained(root)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def make_moe(root: Path, experts: int) -> Path:
    """Write the checkpoint into ``root`` (see the module doc); return ``root``."""
    import torch.multiprocessing as mp

    root.mkdir(parents=True, exist_ok=True)
    store = root.with_name(root.name + ".filestore")
    store.unlink(missing_ok=True)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        mp.start_processes(_worker, args=(str(root), experts, str(store)), nprocs=WORLD, start_method="spawn")
    finally:
        store.unlink(missing_ok=True)
    os.sync()
    return root


def route(src: Path, out: Path) -> None:
    """Today's route: the whole checkpoint into memory, then save_pretrained."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoConfig, AutoModelForCausalLM

    out.mkdir(parents=True)
    whole = out / "whole.pt"
    dcp_to_torch_save(str(src), str(whole))
    state = torch.load(whole, weights_only=True, mmap=False)
    whole.unlink()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src))
    model.load_state_dict(state, assign=True)
    model.save_pretrained(out)
    for f in out.iterdir():
        os.fsync(os.open(f, os.O_RDONLY))


def main() -> None:
    if sys.argv[1:2] == ["route"]:
        route(Path(sys.argv[2]), Path(sys.argv[3]))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=Path)
    p.add_argument("--experts", type=int, default=16)
    a = p.parse_args()
    root = make_moe(a.dir, a.experts)
    print(root, sum(f.stat().st_size for f in root.iterdir()), file=sys.stderr)


if __name__ == "__main__":
    main()
