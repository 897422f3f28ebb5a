"""Checkpoints written by Lightning 2.6's own Trainer and Fabric, run as their users run them:
``torchrun --nproc_per_node 2`` on CPU/gloo, every rank running this file.

Cases (``Trainer(max_steps=2)`` of a tiny LightningModule, ``self.net`` a two-layer MLP, with
Lightning's default ``ModelCheckpoint`` callback, then ``trainer.save_checkpoint``):

* ``ddp.ckpt``: ``strategy="ddp"`` (one torch.save: ``state_dict``, ``optimizer_states``,
  ``callbacks``, ``loops``, ``lr_schedulers``…);
* ``fsdp_sharded.ckpt/``: ``FSDPStrategy(state_dict_type="sharded")``: DCP of ``{"model",
  "optimizer_0"}`` and ``meta.pt``; ``fsdp_full.ckpt``: ``state_dict_type="full"`` (torch.save);
* ``mp.ckpt/``: ``ModelParallelStrategy`` (FSDP2 ``fully_shard`` in ``configure_model``): DCP of
  ``{"state_dict", "optimizer_0"}``;
* ``fabric.ckpt/``: ``Fabric(strategy=ModelParallelStrategy)``'s ``fabric.save`` of
  ``{"model", "optimizer", "step"}``.

Patched here, in this driver only (never Lightning's files), because Lightning's FSDPStrategy
refuses the CPU: the Trainer's check is an exact type check ("requires a GPU accelerator"), so a
subclass passes it; torch's FSDP1 then needs a device id on CPU, which the subclass gives
(``device_id=torch.device("cpu")``, Lightning passes the CPU device's index None); and for
``state_dict_type="full"``, Lightning's ``_get_full_state_dict_context`` hardcodes
``offload_to_cpu=True``, with which torch's FSDP1 full-state-dict hook crashes on CPU (SIGSEGV):
the same context with ``offload_to_cpu=False``. Saving code is untouched.

``live.pt`` beside each holds the trained module's full state dict (rank 0, gathered by torch's
``get_model_state_dict(full_state_dict=True)``). Built once into ``root/lightning-<versions>-v<N>``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

FIXTURE_VERSION = 1
DIM = 16


def _module(fsdp2: bool = False):
    import lightning.pytorch as pl
    import torch

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(DIM, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))

        def configure_model(self):
            if fsdp2:
                from torch.distributed.fsdp import fully_shard

                fully_shard(self.net, mesh=self.device_mesh)

        def training_step(self, batch, _):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.net.parameters(), lr=1e-2)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(1)
            data = torch.utils.data.TensorDataset(torch.randn(16, DIM, generator=g))
            return torch.utils.data.DataLoader(data, batch_size=4)

    return Tiny()


def _cpu_fsdp(**kwargs):
    """Lightning's FSDPStrategy on CPU (see the module docstring for why each change)."""
    import torch
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel

    class CPUFSDPStrategy(FSDPStrategy):
        def _setup_model(self, model):
            return FullyShardedDataParallel(
                module=model,
                cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy,
                device_id=torch.device("cpu"),
                **self.kwargs,
            )

    return CPUFSDPStrategy(**kwargs)


def _no_offload() -> None:
    """``state_dict_type="full"`` on CPU: Lightning's full-state-dict context without the offload."""
    import lightning.pytorch.strategies.fsdp as pl_fsdp
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    def context(module, world_size, rank0_only=True):
        return FSDP.state_dict_type(
            module=module,
            state_dict_type=StateDictType.FULL_STATE_DICT,
            state_dict_config=FullStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only),
            optim_state_dict_config=FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only),
        )

    pl_fsdp._get_full_state_dict_context = context


def _live(model, path: Path) -> None:
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    live = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if torch.distributed.get_rank() == 0:
        torch.save({k: v.detach().clone() for k, v in live.items()}, path)


def _trainer(out: Path, name: str, strategy) -> None:
    import lightning.pytorch as pl

    module = _module(fsdp2=name == "mp")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False,
                         default_root_dir=str(out / f"{name}_logs"), enable_progress_bar=False,
                         enable_model_summary=False)  # fmt: skip
    trainer.fit(module)
    trainer.save_checkpoint(str(out / f"{name}.ckpt"))
    _live(trainer.strategy.model, out / f"{name}.live.pt")


def _fabric(out: Path) -> None:
    import torch
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    def parallelize(model, mesh):
        fully_shard(model, mesh=mesh["data_parallel"])
        return model

    fabric = Fabric(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(parallelize))
    fabric.launch()
    with fabric.init_module(empty_init=False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(DIM, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    model(torch.randn(4, DIM)).pow(2).mean().backward()
    optimizer.step()
    fabric.save(str(out / "fabric.ckpt"), {"model": model, "optimizer": optimizer, "step": 1})
    _live(model, out / "fabric.live.pt")


def _ranks(out: Path, which: str) -> None:
    from lightning.pytorch.strategies import ModelParallelStrategy

    if which == "fabric":
        return _fabric(out)
    _no_offload()
    strategies = {
        "ddp": lambda: "ddp",
        "fsdp_sharded": lambda: _cpu_fsdp(state_dict_type="sharded"),
        "fsdp_full": lambda: _cpu_fsdp(state_dict_type="full"),
        "mp": lambda: ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
    }
    _trainer(out, which, strategies[which]())


def _versions() -> str:
    import lightning
    import torch

    return f"lightning-{lightning.__version__}-torch-{torch.__version__}"


def make_lightning_checkpoints(root: Path) -> Path:
    """Build (once) the cases under ``root``; returns their folder."""
    from helpers import built_once
    from trainer_fixtures import _free_port

    base = Path(root) / f"{_versions()}-v{FIXTURE_VERSION}"

    def build(tmp: Path) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for which in ("ddp", "fsdp_sharded", "fsdp_full", "mp", "fabric"):
            cmd = ["timeout", "600", sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                   f"--master_port={_free_port()}", __file__, str(tmp), which]  # fmt: skip
            for attempt in (1, 2):
                done = subprocess.run(cmd, env=env, capture_output=True, text=True)
                # A rank aborted by gloo's threads at the interpreter's exit (see __main__ below; seen in a
                # fresh-clone CI run of 2026-12-06, after the save): the run is made once more, from scratch.
                aborted = "terminate called without an active exception" in done.stderr
                if done.returncode == 0 or not aborted or attempt == 2:
                    break
                for left in tmp.glob(f"{which}[._]*"):  # its .ckpt (a folder when sharded), logs, .live.pt
                    shutil.rmtree(left) if left.is_dir() else left.unlink()
            if done.returncode:
                raise RuntimeError(f"Lightning {which} run failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")

    return built_once(base, build)


if __name__ == "__main__":
    _ranks(Path(sys.argv[1]), sys.argv[2])
    # Lightning leaves its gloo process group up after fit and save; torn down by the interpreter's
    # exit, its threads abort a rank now and then (SIGABRT, "terminate called without an active
    # exception") after the checkpoint is written. The run's own teardown, as its users' scripts end.
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
