"""The bench's Megatron checkpoint, from Megatron-LM's own training loop, and megatron-core's own
load + save of it (the route an export through megatron-core takes).

    torchrun --nproc-per-node 2 bench/megatron_train.py train ROOT PARAMS   # ROOT/bench/iter_0000001, dims.json
    python bench/megatron_train.py load ROOT DIMS OUT                       # OUT/model.safetensors

``train`` runs bench/megatron_loop.py (``pretrain`` from the megatron-core 0.19.2 wheel as
``pretrain_gpt.py`` runs it, one step, ``--ckpt-format torch_dist``, as the tests' fixtures do) at
pipeline parallel 2 for a GPT of about PARAMS parameters (``bench_dims``: the torchtitan bench
model's shape), its dims in ``ROOT/dims.json``. ``load`` is megatron-core's ``dist_checkpointing.load``
of the whole model at TP=1/PP=1 (megatron_loop ``load_whole``), the Hugging Face split of the loaded
tensors (bench/trainer_ckpt.py ``hf_state``) and ``save_file``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import megatron_loop  # noqa: E402
from trainer_ckpt import hf_state, megatron_dims  # noqa: E402

NAME = "bench"


def bench_dims(params: int) -> tuple:
    """``megatron_dims(params)`` with an even layer count (at least 2: pipeline parallel 2 splits them)."""
    layers, *rest = megatron_dims(params)
    return (max(2, layers + layers % 2), *rest)


def flags(dims: tuple) -> list[str]:
    """megatron_loop's flags for ``dims`` (they override its tiny model's), at pipeline parallel 2."""
    layers, dim, nh, nkv, _, hidden, vocab, *_ = dims
    return (f"--num-layers {layers} --hidden-size {dim} --ffn-hidden-size {hidden} --num-attention-heads {nh} "
            f"--num-query-groups {nkv} --vocab-size {vocab} --pipeline-model-parallel-size 2 "
            "--untie-embeddings-and-output-weights").split()  # fmt: skip


def train(root: Path, params: int) -> None:
    import torch.distributed as dist

    dims = bench_dims(params)
    megatron_loop.start()
    megatron_loop.train(flags(dims), root / NAME)
    if dist.get_rank() == 0:
        (root / "dims.json").write_text(json.dumps(dims))
    dist.destroy_process_group()


def load(root: Path, dims: tuple, out: Path) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")  # fmt: skip
    megatron_loop.start()
    state = megatron_loop.load_whole(flags(dims), root / NAME / f"iter_{megatron_loop.ITERATION:07d}").state_dict()
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in hf_state(state, dims).items()}, str(out / "model.safetensors"))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if sys.argv[1] == "train":
        train(Path(sys.argv[2]), int(sys.argv[3]))
    elif sys.argv[1] == "load":
        load(Path(sys.argv[2]), tuple(json.loads(sys.argv[3])), Path(sys.argv[4]))
    else:
        raise SystemExit(__doc__)
