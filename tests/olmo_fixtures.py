"""Checkpoints written by OLMo-core 3.0.0's own code, as its users run it (FSDP2, 2 gloo ranks).

``make_olmo_checkpoints(root)`` runs ``torchrun --nproc_per_node 2`` on this file: every rank
builds a tiny OLMo 2 (``TransformerConfig.olmo2_14M`` with 2 layers), wraps it with OLMo-core's
own ``TransformerTrainModule`` (FSDP, fp32), takes one AdamW step on random tokens and saves:

* ``dcp/``: ``save_model_and_optim_state(dir, model, optim)`` (``model.*`` and ``optim.*``);
* ``run/step1/`` and ``run/step2/``: the trainer's ``Checkpointer.save`` (``model_and_optim/``,
  ``train/rankR.pt``, ``.metadata.json``), one more step between them; ``run/config.json`` the
  experiment config's model section, as the trainer's ``ConfigSaverCallback`` writes it.

Nothing is patched: OLMo-core runs on CPU/gloo as shipped. Then, in one process, the oracles:
``unshard/`` is ``unshard_checkpoint(dcp, ..., use_safetensors=True)``; ``hf_dcp/`` and
``hf_step2/`` are ``load_model_and_optim_state`` into a fresh model + ``save_hf_model``;
``logits.pt`` holds that model's logits (step 2) on fixed tokens, ``tokens.pt`` the tokens.
Built once into ``root/olmo-<versions>-v<FIXTURE_VERSION>``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

FIXTURE_VERSION = 1
VOCAB = 256
SEQ = 16


def _config():
    from olmo_core.nn.transformer import TransformerConfig

    return TransformerConfig.olmo2_14M(vocab_size=VOCAB, n_layers=2)


def _tokens():
    import torch

    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))


def _step(module) -> None:
    """One AdamW step on the next-token loss of random tokens (every rank its own batch)."""
    import torch
    import torch.nn.functional as F

    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(11 + torch.distributed.get_rank()))
    logits = module.model(ids)
    F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)).backward()
    module.optim.step()
    module.optim.zero_grad(set_to_none=True)


def _ranks(out: Path) -> None:
    import torch
    import torch.distributed as dist
    from olmo_core.distributed.checkpoint import save_model_and_optim_state
    from olmo_core.optim import AdamWConfig
    from olmo_core.train.checkpoint import Checkpointer
    from olmo_core.train.train_module import TransformerTrainModuleConfig
    from olmo_core.train.train_module.transformer.config import TransformerDataParallelConfig

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = _config().build(init_device="cpu")
    module = TransformerTrainModuleConfig(
        rank_microbatch_size=2 * SEQ,
        max_sequence_length=SEQ,
        optim=AdamWConfig(lr=1e-2),
        dp_config=TransformerDataParallelConfig(name="fsdp"),
    ).build(model, device=torch.device("cpu"))
    _step(module)
    save_model_and_optim_state(str(out / "dcp"), module.model, module.optim)
    if dist.get_rank() == 0:  # what the trainer's ConfigSaverCallback writes into the save folder: the
        (out / "run").mkdir(parents=True, exist_ok=True)  # experiment config (here its model section)
        (out / "run" / "config.json").write_text(json.dumps({"model": _config().as_config_dict()}))
    checkpointer = Checkpointer(work_dir=out / "work")
    checkpointer.save(str(out / "run" / "step1"), module, {"global_step": 1})
    _step(module)
    checkpointer.save(str(out / "run" / "step2"), module, {"global_step": 2})
    dist.barrier()
    dist.destroy_process_group()


def _oracles(out: Path) -> None:
    """OLMo-core's own readers, in one process: unshard_checkpoint, and load + save_hf_model."""
    import torch
    from olmo_core.distributed.checkpoint import load_model_and_optim_state, unshard_checkpoint
    from olmo_core.nn.hf.checkpoint import save_hf_model

    unshard_checkpoint(str(out / "dcp"), str(out / "unshard"), optim=False, use_safetensors=True)
    for name, src in (("hf_dcp", out / "dcp"), ("hf_step2", out / "run" / "step2" / "model_and_optim")):
        model = _config().build(init_device="cpu")
        load_model_and_optim_state(str(src), model)
        save_hf_model(str(out / name), model.state_dict(), model)
    torch.save(_tokens(), out / "tokens.pt")
    with torch.no_grad():
        torch.save(model(_tokens()), out / "logits.pt")


def _versions() -> str:
    import torch
    import transformers
    from olmo_core.version import VERSION

    return f"olmo-core-{VERSION}-transformers-{transformers.__version__}-torch-{torch.__version__}"


def make_olmo_checkpoints(root: Path, olmo_path: str) -> Path:
    """Build (once) the fixtures under ``root`` with OLMo-core from ``olmo_path`` (a folder put on
    the children's path); returns their folder."""
    from helpers import built_once

    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([olmo_path, os.environ.get("PYTHONPATH", "")]),
    }
    tag = subprocess.run([sys.executable, __file__, "versions"], env=env, capture_output=True, text=True, timeout=300)
    if tag.returncode:
        raise RuntimeError(f"OLMo-core does not import:\n{tag.stderr[-3000:]}")
    base = Path(root) / f"{tag.stdout.strip()}-v{FIXTURE_VERSION}"

    def build(tmp: Path) -> None:
        from trainer_fixtures import _free_port

        cmd = ["timeout", "900", sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               f"--master_port={_free_port()}", __file__, "ranks", str(tmp)]  # fmt: skip
        for step in (cmd, ["timeout", "600", sys.executable, __file__, "oracles", str(tmp)]):
            done = subprocess.run(step, env=env, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"OLMo-core run failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")

    return built_once(base, build)


if __name__ == "__main__":
    {"versions": lambda: print(_versions()), "ranks": lambda: _ranks(Path(sys.argv[2])),
     "oracles": lambda: _oracles(Path(sys.argv[2]))}[sys.argv[1]]()  # fmt: skip
