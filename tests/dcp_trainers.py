"""DCP checkpoints as trainers write them, by torch 2.13's own writers on CPU/gloo.

``make_trainer_checkpoints(root)`` runs four processes once and saves, each into its own
folder of ``root`` (the oracle for each is torch's own ``dcp_to_torch_save``, or, where
torch cannot read the whole save back, the full tensors in ``*.reference.pt``):

* ``fsdp2``: FSDP2 ``fully_shard`` over 4 ranks, one AdamW step, ``get_state_dict``'s
  model and optimizer beside a train state: ``{"model", "optimizer", "train_state"}``;
  ``app``: the same as the DCP tutorial saves it, ``{"app": AppState}`` (``app.model.*``).
* ``tp``: FSDP + TP on a 2x2 mesh (``_StridedShard``); ``hsdp``: HSDP on a 2x2 mesh.
* ``ddp``: DDP with a ``channels_last`` conv, plus a transposed view: strided blobs.
* ``grid``: ``distribute_tensor`` on a 2x2 mesh with ``[Shard(0), Shard(1)]``: a (1, 6)
  tensor leaves ranks 2 and 3 a (0, 3) chunk with strides (6, 1).
* ``multi``: torchrec-style ``LocalShardsWrapper`` (several column chunks of one tensor
  per rank file); ``plans``: the same, saved by a planner that keeps
  ``Metadata.all_local_plans`` as megatron-core's does.
* ``percoll``: ``use_collectives=False``: one ``__R.metadata`` per rank, replicated
  tensors saved by every rank (reference: ``percoll.reference.pt``).
* ``noflat`` / ``noflat_dtensor``: ``flatten_state_dict=False`` with plain tensors
  (a DDP-style model and its optimizer) and with FSDP2's DTensors.
* ``many``: ``single_file_per_rank=False``, one file per item: MANY tensors, MANY+ files.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

WORLD = 4
MANY = 300
LAYOUTS = ("fsdp2", "app", "tp", "hsdp", "ddp", "grid", "multi", "plans", "percoll", "noflat", "noflat_dtensor", "many")


class Tiny(torch.nn.Module):
    """A two-layer MLP language model: the parameter shapes of a transformer, in small."""

    def __init__(self, vocab: int = 64, dim: int = 16):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(Block(dim) for _ in range(2))
        self.norm = torch.nn.LayerNorm(dim)
        self.output = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


class Block(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.w1 = torch.nn.Linear(dim, 2 * dim)
        self.w2 = torch.nn.Linear(2 * dim, dim)

    def forward(self, h):
        return h + self.w2(torch.relu(self.w1(h)))


def _train_step(model, optimizer) -> None:
    ids = torch.arange(12).reshape(2, 6) % 64
    model(ids).float().pow(2).mean().backward()
    optimizer.step()


def _fsdp2(root: Path, rank: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    model = Tiny()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_step(model, optimizer)
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optimizer": osd, "train_state": {"step": 1}}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(root / "fsdp2")))
    # The DCP tutorial's AppState: {"app": Stateful} whose state_dict is {"model", "optim"}
    dcp.save({"app": _AppState(model, optimizer)}, storage_writer=dcp.FileSystemWriter(str(root / "app")))
    # flatten_state_dict=False: each top-level dict is one pickled object of DTensors
    planner = dcp.DefaultSavePlanner(flatten_state_dict=False)
    dcp.save({"model": msd}, storage_writer=dcp.FileSystemWriter(str(root / "noflat_dtensor")), planner=planner)


class _AppState:
    """The Stateful of torch's DCP tutorial (recipes/distributed_checkpoint_recipe)."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state_dict):
        raise NotImplementedError


def _tp_and_hsdp(root: Path, rank: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = Tiny()
    plan = {}
    for i in range(2):
        plan |= {f"layers.{i}.w1": ColwiseParallel(), f"layers.{i}.w2": RowwiseParallel()}
    parallelize_module(model, mesh["tp"], plan)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    dcp.save({"model": get_model_state_dict(model)}, storage_writer=dcp.FileSystemWriter(str(root / "tp")))

    hsdp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = Tiny()
    fully_shard(model, mesh=hsdp_mesh)
    dcp.save({"model": get_model_state_dict(model)}, storage_writer=dcp.FileSystemWriter(str(root / "hsdp")))


def _ddp(root: Path, rank: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(1)
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Conv2d(4, 6, 1)).to(memory_format=torch.channels_last)
    ddp = DistributedDataParallel(conv)
    state = dict(ddp.state_dict())
    state["module.proj_t"] = torch.arange(35, dtype=torch.float32).reshape(5, 7).t()  # a transposed view
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(root / "ddp")))


def _grid(root: Path, rank: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2))
    g = torch.Generator().manual_seed(7)
    full = {"row": torch.randn(1, 6, generator=g), "mat": torch.randn(5, 6, generator=g)}
    state = {k: distribute_tensor(v, mesh, [Shard(0), Shard(1)]) for k, v in full.items()}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(root / "grid")))


def _columns(rank: int):
    """A torchrec-style column-wise sharded table: rank r holds column blocks r and r + WORLD."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

    full = torch.arange(8 * 32, dtype=torch.float32).reshape(8, 32)
    blocks = [(c, c + 4) for c in range(0, 32, 4)]
    mine = [blocks[rank], blocks[rank + WORLD]]
    local = LocalShardsWrapper([full[:, a:b].contiguous() for a, b in mine], [(0, a) for a, _ in mine])
    mesh = init_device_mesh("cpu", (WORLD,))
    return DTensor.from_local(local, mesh, [Shard(1)], run_check=False, shape=full.shape, stride=full.stride())


def _multi(root: Path, rank: int) -> None:
    import torch.distributed.checkpoint as dcp

    class KeepPlans(dcp.DefaultSavePlanner):
        """megatron-core's save: Metadata.all_local_plans holds every rank's SavePlan."""

        def create_global_plan(self, all_plans):
            plans, metadata = super().create_global_plan(all_plans)
            metadata.all_local_plans = all_plans
            return plans, metadata

    state = {"table": {"weight": _columns(rank)}, "bias": torch.ones(3)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(root / "multi")))
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(root / "plans")), planner=KeepPlans())


def _percoll(root: Path, rank: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    full = percoll_reference()
    state = {
        "model": {"w": distribute_tensor(full["model.w"], mesh, [Shard(0)]), "b": full["model.b"].clone()},
        "table": _columns(rank),
        "step": 3,
    }
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(root / "percoll")), use_collectives=False)


def percoll_reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    table = torch.arange(8 * 32, dtype=torch.float32).reshape(8, 32)
    return {"model.w": torch.randn(10, 4, generator=g), "model.b": torch.randn(4, generator=g), "table": table}


def _worker(rank: int, root: str, store_path: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    try:
        for make in (_fsdp2, _tp_and_hsdp, _ddp, _grid, _multi, _percoll):
            make(Path(root), rank)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _single_process(root: Path) -> None:
    """The layouts one process writes (``no_dist``): flatten_state_dict=False, one file per item."""
    import torch.distributed.checkpoint as dcp

    model = Tiny()
    optimizer = torch.optim.AdamW(model.parameters())
    _train_step(model, optimizer)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 2}
    planner = dcp.DefaultSavePlanner(flatten_state_dict=False)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(root / "noflat")), planner=planner, no_dist=True)
    g = torch.Generator().manual_seed(5)
    many = {f"p{i:03d}": torch.randn(3, generator=g) for i in range(MANY)}
    writer = dcp.FileSystemWriter(str(root / "many"), single_file_per_rank=False)
    dcp.save(many, storage_writer=writer, no_dist=True)


def make_trainer_checkpoints(root: Path) -> dict[str, Path]:
    """Write every layout under ``root``; returns name -> checkpoint directory, and
    ``percoll.reference`` -> the full tensors of ``percoll`` (torch.save)."""
    import warnings

    import torch.multiprocessing as mp

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    store = root / "filestore"
    env = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        mp.start_processes(_worker, args=(str(root), str(store)), nprocs=WORLD, start_method="spawn")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        store.unlink(missing_ok=True)
    with warnings.catch_warnings():  # no_dist: "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore")
        _single_process(root)
    torch.save(percoll_reference(), root / "percoll.reference.pt")
    out = {name: root / name for name in LAYOUTS}
    out["percoll.reference"] = root / "percoll.reference.pt"
    return out


def torch_oracle(directory: Path, out: Path) -> dict[str, torch.Tensor]:
    """What torch's own ``dcp_to_torch_save`` reads back, flattened with dots."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(directory, out)
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}{k}.", v)
        elif isinstance(value, list | tuple):
            for i, v in enumerate(value):
                walk(f"{prefix}{i}.", v)
        elif isinstance(value, torch.Tensor):
            flat[prefix[:-1]] = value

    walk("", torch.load(out, weights_only=False))
    return flat


if __name__ == "__main__":  # python tests/dcp_trainers.py OUT_DIR
    import sys
    import time

    t0 = time.time()
    print(make_trainer_checkpoints(Path(sys.argv[1])), f"{time.time() - t0:.1f}s")
