"""A torch DCP checkpoint of a given size, written by torch's own writers on 2 gloo ranks.

    python bench/dcp_ckpt.py DIR --size 2GiB

Writes ``DIR/hf/`` (``HuggingFaceStorageWriter(save_distributed=True)``: one
``shard-0000{rank+1}-model-00001-of-00001.safetensors`` per rank) and ``DIR/dcp/``
(``FileSystemWriter``: ``.metadata`` + ``__{rank}_0.distcp``) from the same state: a
Llama-shaped model whose tensors are DTensors on a 2-rank CPU mesh, a mix of
``Shard(0)``, ``Shard(1)`` and ``Replicate()``, BF16 and F32. The largest tensor (the
embedding, F32, Shard(0) with an odd row count: the ranks' chunks differ) is about
``size / 8``, at most 256 MiB.

Each rank builds only its own chunks (``DTensor.from_local``), filled from one 16 MiB
block of finite random values, so a rank holds its half of the model, not all of it.
Standalone: nothing here imports streamck or the tests.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from streamck.writer import parse_size

WORLD = 2
MiB = 1 << 20


def plan(size: int) -> list[tuple[str, tuple[int, ...], str, str]]:
    """(name, full shape, dtype 'f32'|'bf16', placement 'S0'|'S1'|'R') until ``size`` bytes."""
    hidden = 2048 if size >= 1 << 30 else (512 if size >= 64 * MiB else 64)
    inter = hidden * 11 // 4
    item = {"f32": 4, "bf16": 2}
    embed = min(size // 8, 256 * MiB)
    vocab = max(3, embed // (hidden * 4)) | 1  # odd: Shard(0) chunks of unequal length
    out = [
        ("model.embed_tokens.weight", (vocab, hidden), "f32", "S0"),
        ("model.norm.weight", (hidden,), "f32", "R"),
        ("lm_head.weight", (vocab, hidden), "bf16", "S1"),
    ]
    layer = [
        ("self_attn.q_proj.weight", (hidden, hidden), "bf16", "S0"),
        ("self_attn.k_proj.weight", (hidden // 4, hidden), "bf16", "S0"),
        ("self_attn.v_proj.weight", (hidden // 4, hidden), "bf16", "S0"),
        ("self_attn.o_proj.weight", (hidden, hidden), "bf16", "S1"),
        ("mlp.gate_proj.weight", (inter, hidden), "f32", "S0"),
        ("mlp.up_proj.weight", (inter, hidden), "f32", "S0"),
        ("mlp.down_proj.weight", (hidden, inter), "f32", "S1"),
        ("input_layernorm.weight", (hidden,), "f32", "R"),
        ("post_attention_layernorm.weight", (hidden,), "bf16", "R"),
    ]

    def nbytes(e):
        n = 1
        for d in e[1]:
            n *= d
        return n * item[e[2]]

    total, i = sum(map(nbytes, out)), 0
    per_layer = sum(map(nbytes, layer))
    while total < size:
        out += [(f"model.layers.{i}.{n}", s, d, p) for n, s, d, p in layer]
        total += per_layer
        i += 1
    return out


def _chunk(n: int, rank: int) -> tuple[int, int]:
    """torch.chunk's split of ``n`` over WORLD ranks (what Shard(d) uses): (start, length)."""
    step = -(-n // WORLD)
    start = min(n, rank * step)
    return start, min(n, start + step) - start


def _worker(rank: int, jobs: list[tuple[str, int]], store_path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        for root, size in jobs:
            _save(rank, mesh, Path(root), size)
        dist.barrier()  # neither rank tears gloo down while the other is still in a collective
    finally:
        dist.destroy_process_group()


def _save(rank: int, mesh, base: Path, size: int) -> None:
    """This rank's chunks of ``plan(size)`` as DTensors, saved by both writers under ``base``."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor, Replicate, Shard

    block = {"f32": torch.randn(4 * MiB, generator=torch.Generator().manual_seed(0))}
    block["bf16"] = block["f32"].to(torch.bfloat16)
    dtypes = {"f32": torch.float32, "bf16": torch.bfloat16}
    state = {}
    for k, (name, shape, dt, place) in enumerate(plan(size)):
        local_shape = list(shape)
        if place != "R":
            local_shape[int(place[1])] = _chunk(shape[int(place[1])], rank)[1]
        t = torch.empty(local_shape, dtype=dtypes[dt])
        flat, src = t.view(-1), block[dt]
        # Chunks differ from one another; a replicated tensor is the same on every rank.
        shift = (k * 7919 + (0 if place == "R" else rank * 104729)) % (src.numel() // 2)
        for i in range(0, flat.numel(), src.numel() - shift):
            n = min(flat.numel() - i, src.numel() - shift)
            flat[i : i + n] = src[shift : shift + n]
        placement = Replicate() if place == "R" else Shard(int(place[1]))
        stride = torch.empty(shape, device="meta").stride()
        state[name] = DTensor.from_local(t, mesh, [placement], run_check=False, shape=torch.Size(shape), stride=stride)
    dcp.save(state, storage_writer=dcp.HuggingFaceStorageWriter(str(base / "hf"), save_distributed=True))
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(base / "dcp")))


def make_dcp(root: Path, size: int) -> dict[str, Path]:
    """Write ``root/hf`` and ``root/dcp`` (see the module doc); return their paths."""
    return make_dcps([(root, size)])[0]


def make_dcps(jobs: list[tuple[Path, int]]) -> list[dict[str, Path]]:
    """``make_dcp`` of each (root, size), all in one launch of the ranks."""
    roots = [Path(r) for r, _ in jobs]
    for root in roots:
        root.mkdir(parents=True, exist_ok=True)
    spawn_ranks(_worker, ([(str(r), n) for r, n in jobs],), roots[0] / "filestore")
    os.sync()
    return [{"hf": root / "hf", "dcp": root / "dcp"} for root in roots]


def spawn_ranks(worker, args: tuple, store: Path) -> None:
    """``worker(rank, *args, STORE)`` on WORLD spawned processes, one thread each, gloo on loopback
    through the FileStore at ``store`` (removed before and after); this process's environment is
    left as it was. tests/dcp_fixtures.py launches its ranks with it too."""
    import torch.multiprocessing as mp

    store.unlink(missing_ok=True)
    env = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        mp.start_processes(worker, args=(*args, str(store)), nprocs=WORLD, start_method="spawn")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        store.unlink(missing_ok=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=Path)
    p.add_argument("--size", default="2GiB")
    a = p.parse_args()
    out = make_dcp(a.dir, parse_size(a.size))
    for k, d in out.items():
        print(k, d, sum(f.stat().st_size for f in d.iterdir()), file=sys.stderr)


if __name__ == "__main__":
    main()
