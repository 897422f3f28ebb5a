"""Real DeepSpeed ZeRO checkpoints, written by DeepSpeed itself on CPU (gloo), with oracles.

``make_zero_checkpoints(root)`` trains a tiny model one AdamW step and saves it, for ZeRO
stages 1–3, 1–3 ranks, fp32 and bf16, in the HF-Trainer layout
``<case>/checkpoint-1/{latest, global_step1/…}``. The model has two param groups, a frozen
layer, a tied lm_head/embedding, float and integer buffers, and numels that no world size
divides; ZeRO-3 runs with a small ``sub_group_size`` so the flat fp32 state spans several
sub-groups (and params straddle them). For each case it saves:

- ``oracle.pt``: ``get_fp32_state_dict_from_zero_checkpoint`` on the checkpoint;
- ``module.pt``: the module's own frozen params and buffers (fp32, before DeepSpeed cast
  them), and ``trained.pt``: every param after the step, gathered from the live engine.

Everything is built once into ``root/deepspeed-<version>-v<FIXTURE_VERSION>`` (a ``done``
marker and ``cases.json``); later calls only read the manifest. Ranks are processes started
with ``torch.multiprocessing`` (spawn); one launch per world size runs every case of that size.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

FIXTURE_VERSION = 1
VOCAB, DIM, HID = 13, 5, 7  # embedding 65, linear 35: neither divides by 2 or 3
SUB_GROUP = 24  # ZeRO-3 sub_group_size, small enough for several sub-groups
STAGES = (1, 2, 3)
WORLDS = (1, 2, 3)
DTYPES = ("fp32", "bf16")
PARAM_NAMES = (
    "embed.weight",
    "body.0.weight",
    "body.0.bias",
    "norm.weight",
    "norm.bias",
    "frozen.weight",
    "frozen.bias",
    "gain",
    "head.weight",
    "lm_head.weight",
)
FROZEN = ("frozen.weight", "frozen.bias")
BUFFERS = ("scale", "pos")


def _model():
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, DIM)
            self.body = nn.Sequential(nn.Linear(DIM, HID), nn.GELU())
            self.norm = nn.LayerNorm(HID)
            self.frozen = nn.Linear(HID, 4)  # bias: 4 elements, rank 2 of 3 holds none
            self.gain = nn.Parameter(torch.full((1,), 1.5))  # 1 element: ranks > 0 hold none
            self.head = nn.Linear(HID, DIM, bias=False)
            self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
            self.lm_head.weight = self.embed.weight  # tied
            self.register_buffer("scale", torch.linspace(0.5, 1.5, HID))
            self.register_buffer("pos", torch.arange(4, dtype=torch.int64))
            for p in self.frozen.parameters():
                p.requires_grad_(False)

        def forward(self, ids):
            h = self.norm(self.body(self.embed(ids))) * self.scale.to(self.embed.weight.dtype)
            h = h * self.gain + self.frozen(h).sum(-1, keepdim=True)
            return self.lm_head(self.head(h))

    return Net()


def cases() -> list[dict]:
    out = []
    for world in WORLDS:
        for stage in STAGES:
            for dtype in DTYPES:
                out.append({"name": f"z{stage}_w{world}_{dtype}", "stage": stage, "world": world, "dtype": dtype})
    return out


def _config(case: dict) -> dict:
    zero = {"stage": case["stage"]}
    if case["stage"] == 3:
        zero.update(sub_group_size=SUB_GROUP, stage3_param_persistence_threshold=0)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.01}},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if case["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _worker(rank: int, world: int, port: int, todo: list[dict], base: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_SIZE=str(world),
        DS_ACCELERATOR="cpu",
    )
    import logging

    import deepspeed
    import torch
    import torch.distributed as dist

    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    for case in todo:
        out = Path(base) / case["name"]
        torch.manual_seed(1234 + case["stage"])
        model = _model()
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            sd = model.state_dict()
            torch.save({k: sd[k].clone() for k in (*FROZEN, *BUFFERS)}, out / "module.pt")
        decay = [p for n, p in model.named_parameters() if p.requires_grad and n.endswith("weight")]
        no_decay = [p for n, p in model.named_parameters() if p.requires_grad and not n.endswith("weight")]
        groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
        engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=_config(case))
        gen = torch.Generator().manual_seed(rank)
        ids = torch.randint(0, VOCAB, (2, 6), generator=gen)
        loss = engine(ids).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        engine.save_checkpoint(str(out / "checkpoint-1"), tag="global_step1")
        params = list(engine.module.named_parameters())
        if case["stage"] == 3:
            with deepspeed.zero.GatheredParameters([p for _, p in params]):
                trained = {n: p.detach().clone().float() for n, p in params}
        else:
            trained = {n: p.detach().clone().float() for n, p in params}
        if rank == 0:
            torch.save(trained, out / "trained.pt")
        dist.barrier()
        engine.destroy()
        del engine
    dist.barrier()
    dist.destroy_process_group()


def _oracle(case_dir: Path) -> None:
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    sd = get_fp32_state_dict_from_zero_checkpoint(str(case_dir / "checkpoint-1"))
    torch.save({k: v.contiguous().clone() for k, v in sd.items()}, case_dir / "oracle.pt")


def _drop_shm(port: int) -> None:
    """DeepSpeed's CPU all-reduce leaves its shared-memory buffers in /dev/shm (GiBs over a
    test session): remove this run's, named by its port."""
    for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
        path.unlink(missing_ok=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_zero_checkpoints(root: Path) -> list[dict]:
    """Build (once) and list the checkpoint matrix under ``root``; each dict has ``name``,
    ``stage``, ``world``, ``dtype`` and paths ``dir``, ``checkpoint`` (``checkpoint-1``),
    ``step_dir`` (``checkpoint-1/global_step1``), ``oracle``, ``module``, ``trained``."""
    import deepspeed

    base = Path(root) / f"deepspeed-{deepspeed.__version__}-v{FIXTURE_VERSION}"
    if not (base / "done").exists():
        import torch.multiprocessing as mp

        os.environ["DS_ACCELERATOR"] = "cpu"
        tmp = base.with_name(base.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        todo = cases()
        for world in WORLDS:
            mine = [c for c in todo if c["world"] == world]
            port = _free_port()
            try:
                mp.start_processes(_worker, args=(world, port, mine, str(tmp)), nprocs=world, start_method="spawn")
            finally:
                _drop_shm(port)
        for c in todo:
            _oracle(tmp / c["name"])
        (tmp / "cases.json").write_text(json.dumps(todo, indent=1))
        (tmp / "done").write_text("ok\n")
        shutil.rmtree(base, ignore_errors=True)
        tmp.rename(base)
    out = []
    for c in json.loads((base / "cases.json").read_text()):
        d = base / c["name"]
        out.append(
            {
                **c,
                "dir": d,
                "checkpoint": d / "checkpoint-1",
                "step_dir": d / "checkpoint-1" / "global_step1",
                "oracle": d / "oracle.pt",
                "module": d / "module.pt",
                "trained": d / "trained.pt",
            }
        )
    return out


def _odd_worker(rank: int, port: int, base: str) -> None:
    """One rank of DeepSpeed training a model with a trainable param of no elements and an
    F64 buffer, under ZeRO-1 and ZeRO-2 (ZeRO-3 cannot run a param of no elements)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE="1", LOCAL_SIZE="1", DS_ACCELERATOR="cpu")  # fmt: skip
    import logging

    import deepspeed
    import torch
    from torch import nn

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.empty = nn.Parameter(torch.empty(0))
            self.register_buffer("f64", torch.linspace(0, 1, 3, dtype=torch.float64))

        def forward(self, x):
            return self.lin(x).sum() + self.empty.sum() + self.f64.float().sum()

    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    for stage in (1, 2):
        model = Odd()
        cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
               "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}  # fmt: skip
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        engine.backward(engine(torch.ones(1, 4)))
        engine.step()
        engine.save_checkpoint(f"{base}/z{stage}", tag="global_step1")
    # Lightning's DeepSpeedStrategy.save_checkpoint (2.6.1) hands DeepSpeed its checkpoint dict,
    # less state_dict and optimizer_states, as client_state under the tag "checkpoint"; its
    # strategy refuses to run without CUDA, so the dict is the one its dump_checkpoint builds.
    import argparse

    try:
        import lightning
        from lightning.fabric.utilities.data import AttributeDict
        from omegaconf import OmegaConf
    except ImportError:  # scripts/test installs it; the test that needs it says so
        return

    client = {
        "epoch": 0,
        "global_step": 1,
        "pytorch-lightning_version": lightning.__version__,
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 1}}}},
        "callbacks": {},
        "lr_schedulers": [],
        "hparams_name": "kwargs",
        "hyper_parameters": {"lr": 0.1, "args": argparse.Namespace(layers=2), "extra": AttributeDict(seed=7)},
    }
    # a Hydra run's save_hyperparameters(cfg) keeps its DictConfig as it is
    client["hyper_parameters"]["cfg"] = OmegaConf.create({"model": {"layers": 2}, "tags": ["a"], "lr": 0.1})
    engine.save_checkpoint(f"{base}/epoch=0-step=1.ckpt", client_state=client, tag="checkpoint")


def make_odd_checkpoints(root: Path) -> dict[int, Path]:
    """ZeRO-1 and ZeRO-2 checkpoints (``global_step1`` by stage) of a model with a trainable
    param of no elements (``empty``) and an F64 buffer (``f64``), written by DeepSpeed; under
    key ``"lightning"``, the ZeRO-2 one saved as Lightning saves (``epoch=0-step=1.ckpt/``)."""
    import torch.multiprocessing as mp

    port = _free_port()
    try:
        mp.start_processes(_odd_worker, args=(port, str(root)), nprocs=1, start_method="spawn")
    finally:
        _drop_shm(port)
    found = {stage: Path(root) / f"z{stage}" / "global_step1" for stage in (1, 2)}
    return {**found, "lightning": Path(root) / "epoch=0-step=1.ckpt"}


if __name__ == "__main__":
    import sys
    import time

    t = time.time()
    got = make_zero_checkpoints(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/zero-fixtures"))
    print(len(got), "cases in", round(time.time() - t, 1), "s")
