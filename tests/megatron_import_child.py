"""Megatron-LM's own load of what ``streamck rewrite HF -o RUN --format megatron`` wrote, one rank of a
``torchrun --nproc-per-node 4`` launch (CPU/gloo, the plumbing of bench/megatron_loop.py).

    torchrun --nproc-per-node 4 tests/megatron_import_child.py JOBS.json OUT

JOBS.json is a list of ``{"name", "run", "flags", "train", "layouts"}``: a run root streamck wrote
and the model's Megatron-LM flags (beside megatron_loop.COMMON, which they override). For each job,
at each of its layouts (TP, PP, EP; LAYOUTS unless it names them): the model from Megatron-LM's own
builder (``gpt_config_from_args``, ``GPTModelBuilder``) for this rank's stage, megatron-core's
``dist_checkpointing.load`` of ``RUN/iter_0000000`` with ``StrictHandling.RAISE_UNEXPECTED`` (every
key the model asks for must be there) and a strict ``load_state_dict``, then its fp32 forward on the
fixed tokens of bench/megatron_ckpt.py: the stages run in turn (the first's hidden states sent to the
last), the last stage's vocabulary-parallel logits gathered over TP; ``OUT/<name>-tp<T>pp<P>ep<E>.pt``
holds them.
Where ``train`` is set, Megatron-LM's training loop (megatron_loop.train: ``pretrain`` as
``pretrain_gpt.py`` runs it) takes one step at TP=2 x PP=2 from ``--load RUN --finetune`` with a
zero learning rate, saved under ``OUT/<name>-trained``: its weights are then the loaded ones.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from megatron_ckpt import fixed_tokens, forward
from megatron_loop import COMMON, _args, reset, start, train

LAYOUTS = ((1, 1, 1), (2, 2, 1))  # (TP, PP, EP); a job may name its own
WORLD = 4


def build(flags: list[str], tp: int, pp: int, ep: int):
    """This rank's stage of the model of COMMON + ``flags`` at (tp, pp, ep), from Megatron-LM's builder."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.models.gpt import GPTModelBuilder

    layout = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
              "--expert-model-parallel-size", str(ep)]  # fmt: skip
    args = _args([*COMMON, *flags, *layout, "--global-batch-size", str(WORLD)])
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep)  # fmt: skip
    model_parallel_cuda_manual_seed(args.seed)
    config = gpt_config_from_args(args)
    config.finalize()
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    return GPTModelBuilder(config).build_model(pg_collection=None, pre_process=first, post_process=last), args


def load(model, step: Path) -> None:
    """megatron-core's own load: every key the model asks for must be in the checkpoint."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(step),
                                    strict=StrictHandling.RAISE_UNEXPECTED)  # fmt: skip
    model.load_state_dict(state["model"], strict=True)


def logits(model, tokens, hidden: int, tp: int):
    """The stages' forward in turn; the full-vocabulary logits on the last stage, None elsewhere."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    batch, n = tokens.shape
    with torch.no_grad():
        if not ps.is_pipeline_first_stage():
            h = torch.empty(n, batch, hidden)
            dist.recv(h, ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(h)
        out = forward(model.eval(), tokens)
        if not ps.is_pipeline_last_stage():
            dist.send(out.contiguous(), ps.get_pipeline_model_parallel_next_rank())
            return None
        return gather_from_tensor_model_parallel_region(out) if tp > 1 and model.parallel_output else out


def one(job: dict, tp: int, pp: int, ep: int, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    model, args = build(job["flags"], tp, pp, ep)
    load(model, Path(job["run"]) / "iter_0000000")
    got = logits(model, fixed_tokens(args.vocab_size), args.hidden_size, tp)
    if got is not None and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
        saved = {"tokens": fixed_tokens(args.vocab_size), "logits": got.float()}
        torch.save(saved, out / f"{job['name']}-tp{tp}pp{pp}ep{ep}.pt")
    dist.barrier()
    reset()


def main(jobs: list[dict], out: Path) -> None:
    import torch.distributed as dist

    start()
    for job in jobs:
        for tp, pp, ep in job.get("layouts") or LAYOUTS:
            one(job, tp, pp, ep, out)
        if job.get("train"):
            step = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--load", job["run"],
                    "--finetune", "--lr", "0", "--min-lr", "0"]  # fmt: skip
            train([*job["flags"], *step], out / f"{job['name']}-trained")
            dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    main(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
