"""Checkpoints written by Hugging Face ``Trainer`` + DeepSpeed, run as its users run it.

``make_trainer_checkpoints(root)`` launches ``torchrun --nproc_per_node W`` on CPU/gloo
(``DS_ACCELERATOR=cpu``) for each world size; every rank runs this file, which trains a
tiny Llama (built from a config) for two steps on random tokens with ``save_steps=1``, so
each case leaves ``checkpoint-1/`` and ``checkpoint-2/`` as Trainer writes them: DeepSpeed's
``global_stepN/`` and ``latest``, plus ``model.safetensors`` when the 16-bit weights are
gathered. Trainer makes its usual two parameter groups (weight decay / none).

The embedding is 2048 x 64 (131,072 elements), above ZeRO-3's default
``stage3_param_persistence_threshold`` (1e5); everything else is below it. So under ZeRO-3
a ``save_pretrained`` call on rank 0 writes the norms and projections whole and the
embedding (and an untied head) as ``[0]``: rank 0 writes that file (``placeholder/``), and
the empty file ``Trainer._save`` writes for a plain module when nothing is gathered
(``save_file({})``, ``empty/``), so the tests can put them where users
find them.

Two settings apply to the training script only, as on any GPU-less host: accelerate is told
the backend is gloo, and bf16 is allowed on the CPU (``is_torch_bf16_gpu_available``).

Beside each case: ``oracle.pt``, DeepSpeed's own ``get_fp32_state_dict_from_zero_checkpoint``
of ``checkpoint-2`` (which refuses BF16_Optimizer files), and ``live.pt``, every trainable
parameter's fp32 master weights taken from the live engine by ``safe_get_full_fp32_param``.
Built once into ``root/trainer-<versions>-v<FIXTURE_VERSION>``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from helpers import built_once

FIXTURE_VERSION = 1
VOCAB, DIM, FFN, LAYERS = 2048, 64, 96, 2
BIG = ("model.embed_tokens.weight", "lm_head.weight")  # above the persistence threshold

# name, world, ZeRO stage, dtype, tied, frozen embedding, gathered 16-bit weights, extra config
CASES = [
    ("z3_tied_bf16_gathered", 2, 3, "bf16", True, False, True, {}),
    ("z3_untied_fp32", 2, 3, "fp32", False, False, False, {}),
    ("z2_untied_bf16_frozen", 2, 2, "bf16", False, True, False, {}),
    ("z1_bf16_fp32accum", 2, 1, "bf16", False, False, False, {"data_types": {"grad_accum_dtype": "fp32"}}),
    ("z1_tied_fp32_frozen_w3", 3, 1, "fp32", True, True, False, {}),
    ("z3_tied_bf16_w3", 3, 3, "bf16", True, False, False, {}),
]
KEYS = ("name", "world", "stage", "dtype", "tied", "frozen", "gathered", "extra")


def cases() -> list[dict]:
    return [dict(zip(KEYS, c, strict=True)) for c in CASES]


def llama_config(tied: bool):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=DIM,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )


def _ds_config(case: dict) -> dict:
    zero = {"stage": case["stage"]}
    if case["stage"] == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = case["gathered"]
    cfg = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": zero,
        "bf16": {"enabled": "auto"},
        "steps_per_print": 10**9,
        **case["extra"],
    }
    return cfg


def _train(case: dict, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(1000 + case["stage"])
    model = LlamaForCausalLM(llama_config(case["tied"]))
    if case["frozen"]:
        model.model.embed_tokens.weight.requires_grad_(False)
    gen = torch.Generator().manual_seed(7)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, VOCAB, (16, 12), generator=gen)]
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=2,
        save_steps=1,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        weight_decay=0.01,
        bf16=case["dtype"] == "bf16",
        deepspeed=_ds_config(case),
        ddp_backend="gloo",
        report_to="none",
        logging_steps=100,
        disable_tqdm=True,
        save_only_model=False,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    assert trainer.accelerator.num_processes == case["world"], "batches sized for the wrong world"
    live = _fp32_masters(trainer.model_wrapped)
    if dist.get_rank() == 0:
        torch.save(live, out / "live.pt")
    if case["stage"] == 3 and dist.get_rank() == 0:
        trainer.model.save_pretrained(out / "placeholder")
        # what Trainer._save writes for a model that is not a PreTrainedModel, given the
        # empty state dict it passes when nothing is gathered (trainer.py, save_model)
        (out / "empty").mkdir()
        save_file({}, str(out / "empty" / "model.safetensors"), metadata={"format": "pt"})
    dist.barrier()


def _fp32_masters(engine) -> dict:
    """Every trainable parameter's fp32 master weights from the live engine, through
    DeepSpeed's own ``safe_get_full_fp32_param`` (collective under ZeRO-3)."""
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            full = safe_get_full_fp32_param(p)
            out[name] = full.detach().clone() if full is not None else None
    return out


def _gloo_backend() -> None:
    """Tell accelerate that torchrun's ranks talk over gloo: with no GPU it finds no backend,
    and Trainer would size batches for one process while DeepSpeed sees the whole world."""
    from accelerate.state import DistributedType, PartialState

    prepare = PartialState._prepare_backend

    def gloo(self, cpu=False, sagemaker_dp=False, backend=None):
        found, kind = prepare(self, cpu, sagemaker_dp, backend)
        return ("gloo", DistributedType.MULTI_CPU) if kind == DistributedType.NO else (found, kind)

    PartialState._prepare_backend = gloo


def _worker(todo: list[dict], base: Path) -> None:
    import logging

    import deepspeed
    import transformers.training_args as targs
    from transformers.utils import logging as hf_logging

    deepspeed.utils.logger.setLevel(logging.WARNING)
    hf_logging.set_verbosity_error()
    targs.is_torch_bf16_gpu_available = lambda: True  # bf16 on the CPU
    _gloo_backend()
    for case in todo:
        _train(case, base / case["name"])


def _oracle(case_dir: Path) -> None:
    """zero_to_fp32's output; it refuses BF16_Optimizer files, whose oracle is ``live.pt``."""
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    sd = get_fp32_state_dict_from_zero_checkpoint(str(case_dir / "checkpoint-2"))
    torch.save({k: v.contiguous().clone() for k, v in sd.items()}, case_dir / "oracle.pt")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _versions() -> str:
    import deepspeed
    import transformers

    return f"transformers-{transformers.__version__}-deepspeed-{deepspeed.__version__}"


def make_trainer_checkpoints(root: Path) -> dict[str, dict]:
    """Build (once) and list the cases under ``root``, by name; each dict has the case's
    fields and paths ``dir``, ``checkpoint`` (``checkpoint-2``), ``oracle`` (None where zero_to_fp32
    refuses the files), ``live``."""
    base = Path(root) / f"trainer-{_versions()}-v{FIXTURE_VERSION}"

    def build(tmp: Path) -> None:
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "ACCELERATE_USE_CPU": "false", "OMP_NUM_THREADS": "1"}
        for world in sorted({c["world"] for c in cases()}):
            port = _free_port()
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
                   f"--master_port={port}", __file__, str(tmp), str(world)]  # fmt: skip
            try:
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            finally:
                for p in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
                    p.unlink(missing_ok=True)
            if done.returncode:
                raise RuntimeError(f"Trainer run (world {world}) failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
        for c in cases():
            if "data_types" not in c["extra"]:
                _oracle(tmp / c["name"])
        (tmp / "cases.json").write_text(json.dumps(cases(), indent=1))

    built_once(base, build)
    out = {}
    for c in json.loads((base / "cases.json").read_text()):
        d = base / c["name"]
        oracle = d / "oracle.pt"
        out[c["name"]] = {
            **c,
            "dir": d,
            "checkpoint": d / "checkpoint-2",
            "oracle": oracle if oracle.exists() else None,
            "live": d / "live.pt",
        }
    return out


if __name__ == "__main__":
    if len(sys.argv) == 3:  # a torchrun rank
        base, world = Path(sys.argv[1]), int(sys.argv[2])
        _worker([c for c in cases() if c["world"] == world], base)
    else:
        import time

        t = time.time()
        got = make_trainer_checkpoints(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/trainer-fixtures"))
        print(len(got), "cases in", round(time.time() - t, 1), "s")
