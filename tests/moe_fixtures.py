"""MoE checkpoints written by FSDP2 and by Hugging Face Trainer + FSDP, run as their users run them.

``make_moe_checkpoints(root)`` launches ``torchrun --nproc_per_node 2`` on CPU/gloo. Every rank
runs this file: for each family in FAMILIES (tests/moe_models.py's tiny Qwen3-MoE and Mixtral,
transformers 5 models whose experts are fused ``experts.gate_up_proj`` / ``experts.down_proj``
at run time) it

* wraps the model with torch's ``fully_shard`` (each decoder layer, then the root), trains two
  AdamW steps on random tokens and saves ``dcp.save(model.state_dict(), checkpoint_id=fsdp2/)``,
  the FSDP2 recipe; the model's config.json is put beside it, as users keep it;
* trains the same model with ``Trainer`` (``fsdp="full_shard"``, FSDP2, SHARDED_STATE_DICT,
  ``save_steps=1``), leaving ``trainer/checkpoint-2/pytorch_model_fsdp_0/``; Trainer writes no
  config.json there, so the build puts the model's in ``checkpoint-2/`` as the README tells users.

Oracles beside each: ``hf/``, ``save_pretrained`` of the FSDP2-trained weights (gathered by
``get_model_state_dict(full_state_dict=True)`` and loaded into a fresh model on rank 0), and
``live.pt`` / ``trainer_live.pt``, the full state dicts taken live. The Trainer run uses the
GPU-less settings of tests/fsdp_fixtures.py (gloo backend, FSDP on MULTI_CPU). Built once into
``root/moe-<versions>-v<FIXTURE_VERSION>``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from helpers import built_once
from moe_models import VOCAB, tiny_model
from trainer_fixtures import _free_port, _gloo_backend

FIXTURE_VERSION = 1
FAMILIES = ("qwen3_moe", "mixtral")


def _layers(model):
    return model.model.layers


def _fsdp2(model_type: str, out: Path) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    model = tiny_model(model_type, seed=11).train()
    for layer in _layers(model):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(5 + dist.get_rank())
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (2, 12), generator=gen)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad()
    dcp.save(model.state_dict(), checkpoint_id=str(out / "fsdp2"))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if dist.get_rank() == 0:
        model.config.save_pretrained(out / "fsdp2")  # the config users keep beside their save
        torch.save({k: v.detach().clone() for k, v in full.items()}, out / "live.pt")
        plain = tiny_model(model_type)
        plain.load_state_dict(full)
        plain.save_pretrained(out / "hf")
    dist.barrier()


def _trainer(model_type: str, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import Trainer, TrainingArguments

    model = tiny_model(model_type, seed=12).train()
    gen = torch.Generator().manual_seed(7)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, VOCAB, (8, 12), generator=gen)]
    layer_cls = type(_layers(model)[0]).__name__
    fsdp_config = {"version": 2, "state_dict_type": "SHARDED_STATE_DICT", "transformer_layer_cls_to_wrap": [layer_cls]}
    fsdp_config["auto_wrap_policy"] = "TRANSFORMER_BASED_WRAP"
    args = TrainingArguments(
        output_dir=str(out / "trainer"),
        max_steps=2,
        save_steps=1,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        fsdp="full_shard",
        fsdp_config=fsdp_config,
        ddp_backend="gloo",
        report_to="none",
        logging_steps=100,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    live = get_model_state_dict(trainer.model_wrapped, options=StateDictOptions(full_state_dict=True))
    if dist.get_rank() == 0:
        torch.save({k: v.detach().clone() for k, v in live.items()}, out / "trainer_live.pt")
        model.config.save_pretrained(out / "trainer" / "checkpoint-2")  # "add the model's config.json"
    dist.barrier()


def _worker(base: Path) -> None:
    from fsdp_fixtures import _fsdp_on_cpu
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    _gloo_backend()
    _fsdp_on_cpu()
    import torch.distributed as dist

    for model_type in FAMILIES:
        _fsdp2(model_type, base / model_type)
    for model_type in FAMILIES:
        _trainer(model_type, base / model_type)
    if dist.is_initialized():
        dist.barrier()


def _versions() -> str:
    import torch
    import transformers

    return f"transformers-{transformers.__version__}-torch-{torch.__version__}"


def make_moe_checkpoints(root: Path) -> dict[str, dict[str, Path]]:
    """Build (once) and list the runs under ``root`` by family: paths ``fsdp2``, ``hf``, ``live``,
    ``trainer`` (``checkpoint-2``) and ``trainer_live``."""
    base = Path(root) / f"moe-{_versions()}-v{FIXTURE_VERSION}"

    def build(tmp: Path) -> None:
        env = {**os.environ, "ACCELERATE_USE_CPU": "false", "ACCELERATE_TORCH_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               f"--master_port={_free_port()}", __file__, str(tmp), "rank"]  # fmt: skip
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode:
            raise RuntimeError(f"FSDP2 / Trainer MoE run failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
        for model_type in FAMILIES:
            shutil.rmtree(tmp / model_type / "trainer" / "checkpoint-1")
        (tmp / "families.json").write_text(json.dumps(FAMILIES))

    built_once(base, build)
    return {
        f: {
            "fsdp2": base / f / "fsdp2",
            "hf": base / f / "hf",
            "live": base / f / "live.pt",
            "trainer": base / f / "trainer" / "checkpoint-2",
            "trainer_live": base / f / "trainer_live.pt",
        }
        for f in json.loads((base / "families.json").read_text())
    }


if __name__ == "__main__":
    if len(sys.argv) == 3:  # a torchrun rank
        _worker(Path(sys.argv[1]))
    else:
        print(make_moe_checkpoints(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/moe-fixtures")))
