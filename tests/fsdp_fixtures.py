"""Checkpoints written by Hugging Face ``Trainer`` + FSDP (accelerate), run as its users run it.

``make_fsdp_checkpoints(root)`` launches ``torchrun --nproc_per_node 2`` on CPU/gloo; every
rank runs this file, which trains the tiny Llama of ``trainer_fixtures`` (built from a
config) for two steps on random tokens with ``save_steps=1`` and
``TrainingArguments(fsdp="full_shard", fsdp_config={"version": V, "state_dict_type": T})``,
so each case leaves ``checkpoint-1/`` and ``checkpoint-2/`` as Trainer writes them through
accelerate's ``save_fsdp_model``: for SHARDED_STATE_DICT (FSDP1 and FSDP2)
``pytorch_model_fsdp_0/`` (DCP of ``{"model": sd}``) beside ``optimizer_0/`` and no
config.json; for FSDP1's LOCAL_STATE_DICT ``pytorch_model_fsdp_rank{R}.bin``.

Settings for a GPU-less host, in the training script and its environment only: accelerate
is told the backend is gloo (``trainer_fixtures._gloo_backend``); accelerate 1.15 turns a
``fsdp_plugin`` into ``DistributedType.FSDP`` only on an accelerator (MULTI_GPU/NPU/XPU/...,
never MULTI_CPU), so ``_fsdp_on_cpu`` lets it stand on MULTI_CPU; ``ACCELERATE_TORCH_DEVICE=cpu``
(accelerate's device is otherwise ``cpu:0``, which FSDP1 refuses against its compute device
``cpu``); FSDP1 gets ``sync_module_states: false`` (true asks for an accelerator's device).

FULL_STATE_DICT does not save through Trainer on CPU: with FSDP1, accelerate forces
``offload_to_cpu`` for more than one process and torch's unshard into the offload copy
crashes (SIGSEGV); with FSDP2, Trainer's ``save_model`` calls ``save_pretrained`` on rank 0
alone with DTensors, a collective the other rank never joins (gloo size mismatch). So
``full/pytorch_model_fsdp.bin`` is accelerate's own ``save_fsdp_model`` with FULL_STATE_DICT,
called on every rank on the trained FSDP2 model after ``train()``; ``per_rank/`` the same call
with SHARDED_STATE_DICT and ``use_dcp=False`` (``pytorch_model_fsdp_0_rank{R}.bin``).

Beside each case: ``base/config.json``, the config the run started from; ``live.pt``, the
trained model's full state dict from torch's ``get_model_state_dict(full_state_dict=True)``
on every rank; and for SHARDED_STATE_DICT ``merged/``, accelerate's own
``merge_fsdp_weights`` of ``checkpoint-2/pytorch_model_fsdp_0`` (what ``accelerate
merge-weights`` runs). Built once into ``root/fsdp-<versions>-v<FIXTURE_VERSION>``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import built_once
from trainer_fixtures import VOCAB, _free_port, _gloo_backend, llama_config

FIXTURE_VERSION = 2

# name, FSDP version, state_dict_type, tied head
CASES = [
    ("fsdp2_sharded_tied", 2, "SHARDED_STATE_DICT", True),
    ("fsdp2_sharded_untied", 2, "SHARDED_STATE_DICT", False),
    ("fsdp1_sharded_tied", 1, "SHARDED_STATE_DICT", True),
    ("fsdp1_local_untied", 1, "LOCAL_STATE_DICT", False),
]
KEYS = ("name", "version", "state_dict_type", "tied")


def cases() -> list[dict]:
    return [dict(zip(KEYS, c, strict=True)) for c in CASES]


def _fsdp_on_cpu() -> None:
    """Let accelerate's FSDP plugin stand on a MULTI_CPU (gloo) run: accelerate 1.15 sets
    ``DistributedType.FSDP`` only on accelerators, though torch's FSDP runs on CPU."""
    from accelerate.state import AcceleratorState, DistributedType

    init = AcceleratorState.__init__

    def on_cpu(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)

    AcceleratorState.__init__ = on_cpu


def _train(case: dict, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(2000 + case["version"])
    model = LlamaForCausalLM(llama_config(case["tied"]))
    gen = torch.Generator().manual_seed(7)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, VOCAB, (16, 12), generator=gen)]
    fsdp_config = {
        "version": case["version"],
        "state_dict_type": case["state_dict_type"],
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
    }
    if case["version"] == 1:  # FSDP1's default (true) asks for an accelerator's current device
        fsdp_config["sync_module_states"] = False
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=2,
        save_steps=1,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        weight_decay=0.01,
        fsdp="full_shard",
        fsdp_config=fsdp_config,
        ddp_backend="gloo",
        report_to="none",
        logging_steps=100,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    state = trainer.accelerator.state
    assert trainer.accelerator.num_processes == 2 and state.fsdp_plugin.fsdp_version == case["version"]
    live = get_model_state_dict(trainer.model_wrapped, options=StateDictOptions(full_state_dict=True))
    if dist.get_rank() == 0:
        torch.save({k: v.detach().clone() for k, v in live.items()}, out / "live.pt")
        model.config.save_pretrained(out / "base")  # the config the run started from
    if case["version"] == 2 and case["state_dict_type"] == "SHARDED_STATE_DICT":
        _save_per_rank(trainer, out / "per_rank")  # first: the FULL save leaves rank0_only set on the plugin
        _save_full(trainer, out / "full")
    dist.barrier()


def _save_full(trainer, out: Path) -> None:
    """FULL_STATE_DICT's ``pytorch_model_fsdp.bin`` as accelerate's own ``save_fsdp_model``
    writes it, from the trained model (Trainer cannot save FULL_STATE_DICT on CPU: see above)."""
    from accelerate.utils import save_fsdp_model

    plugin = trainer.accelerator.state.fsdp_plugin
    kept = plugin.state_dict_type
    plugin.set_state_dict_type("FULL_STATE_DICT")
    save_fsdp_model(plugin, trainer.accelerator, trainer.model_wrapped, str(out))
    plugin.set_state_dict_type(kept)


def _save_per_rank(trainer, out: Path) -> None:
    """SHARDED_STATE_DICT saved per rank, ``pytorch_model_fsdp_0_rank{R}.bin``, as accelerate's
    own ``save_fsdp_model(..., use_dcp=False)`` writes it."""
    from accelerate.utils import save_fsdp_model

    plugin = trainer.accelerator.state.fsdp_plugin
    save_fsdp_model(plugin, trainer.accelerator, trainer.model_wrapped, str(out), use_dcp=False)


def _worker(base: Path) -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    _gloo_backend()
    _fsdp_on_cpu()
    for case in cases():
        _train(case, base / case["name"])


def _merge(case_dir: Path) -> None:
    """accelerate's own ``merge_fsdp_weights`` (``accelerate merge-weights``) of checkpoint-2."""
    from accelerate.utils import merge_fsdp_weights

    merge_fsdp_weights(str(case_dir / "checkpoint-2" / "pytorch_model_fsdp_0"), str(case_dir / "merged"))


def _versions() -> str:
    import accelerate
    import torch
    import transformers

    return f"transformers-{transformers.__version__}-accelerate-{accelerate.__version__}-torch-{torch.__version__}"


def make_fsdp_checkpoints(root: Path) -> dict[str, dict]:
    """Build (once) and list the cases under ``root``, by name; each dict has the case's
    fields and paths ``dir``, ``checkpoint`` (``checkpoint-2``), ``live`` and ``merged``
    (None but for SHARDED_STATE_DICT)."""
    base = Path(root) / f"fsdp-{_versions()}-v{FIXTURE_VERSION}"

    def build(tmp: Path) -> None:
        env = {**os.environ, "ACCELERATE_USE_CPU": "false", "ACCELERATE_TORCH_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               f"--master_port={_free_port()}", __file__, str(tmp), "rank"]  # fmt: skip
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode:
            raise RuntimeError(f"Trainer + FSDP run failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
        for c in cases():
            if c["state_dict_type"] == "SHARDED_STATE_DICT":
                _merge(tmp / c["name"])
        (tmp / "cases.json").write_text(json.dumps(cases(), indent=1))

    built_once(base, build)
    out = {}
    for c in json.loads((base / "cases.json").read_text()):
        d = base / c["name"]
        merged = d / "merged"
        out[c["name"]] = {
            **c,
            "dir": d,
            "checkpoint": d / "checkpoint-2",
            "live": d / "live.pt",
            "merged": merged if merged.exists() else None,
        }
    return out


if __name__ == "__main__":
    if len(sys.argv) == 3:  # a torchrun rank
        _worker(Path(sys.argv[1]))
    else:
        import time

        t = time.time()
        got = make_fsdp_checkpoints(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/fsdp-fixtures"))
        print(len(got), "cases in", round(time.time() - t, 1), "s")
