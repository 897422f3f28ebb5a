"""Megatron-LM's own training loop on CPU/gloo: ``megatron.training.pretrain`` from the megatron-core
0.19.2 wheel, as Megatron-LM's ``pretrain_gpt.py`` (branch ``core_r0.19.0``) runs it, for the tests'
fixtures (tests/megatron_train_fixtures.py) and the bench (bench/megatron_train.py).

``train(flags, save)`` is one run: the flags parsed by ``parse_and_validate_args``, the model from
``gpt_config_from_args`` (the wheel's GPTModelBuilder), ``pretrain_cfg_container_from_args``, then
``pretrain`` with its 1F1B schedule, DDP, Adam and ``save_checkpoint`` (``--ckpt-format torch_dist``,
mock data). pretrain_gpt.py is not in the wheel: ``forward_step`` and the datasets provider here are
its own reduced to what these flags reach (a mock-data GPT batch broadcast over tensor parallel, the
masked token loss), and ``get_embedding_ranks`` is its own. ``load_whole(flags, step)`` is
megatron-core's own ``dist_checkpointing.load`` of a saved step into the model of the same flags at
TP=1/PP=1/EP=1. COMMON: a tiny Llama-style GPT (RMSNorm, SwiGLU, RoPE, GQA, the vocabulary padded past
the tokenizer's) and the flags the CPU forces; later flags override it.

Device plumbing only (/work/shared/producers-on-cpu.md), none in checkpointing or the model's
math: ``torch.cuda`` queries answered for the CPU, ``.cuda()`` the identity, no-op streams and
events, ``device="cuda"`` creation made on the CPU, a stand-in ``triton`` while megatron imports,
the JIT warm-up and the dataset helpers' compile step skipped, the gloo group made first (``start``).
Flags the CPU forces: ``--clip-grad 0`` (clipping asserts CUDA tensors), no distributed optimizer,
no fusions, ``--no-gradient-accumulation-fusion``, ``--num-workers 0``.
"""

from __future__ import annotations

import contextlib
import sys
import types
import typing
from functools import partial
from pathlib import Path

from standins import without_triton

ITERATION = 1
SEQ = 16
VOCAB = 250  # NullTokenizer's --vocab-size; Megatron pads the embedding to a multiple of 128 x TP
# One Llama-style GPT for every run: 4 layers, hidden 64, 4 heads in 2 query groups, head dim 16.
COMMON = (
    "--num-layers 4 --hidden-size 64 --ffn-hidden-size 96 --num-attention-heads 4 --group-query-attention "
    "--num-query-groups 2 --seq-length 16 --max-position-embeddings 16 --normalization RMSNorm --norm-epsilon 1e-6 "
    "--swiglu --position-embedding-type rope --rotary-base 500000 --disable-bias-linear --attention-dropout 0 "
    "--hidden-dropout 0 --init-method-std 0.1 --transformer-impl local --tokenizer-type NullTokenizer "
    f"--vocab-size {VOCAB} --mock-data --split 1,0,0 --micro-batch-size 1 --global-batch-size 2 --train-iters 1 "
    "--lr 1e-3 --min-lr 1e-3 --lr-decay-style constant --seed 1234 --eval-iters 0 --eval-interval 1000 "
    "--save-interval 1 --ckpt-format torch_dist --clip-grad 0.0 --no-gradient-accumulation-fusion "
    "--no-bias-swiglu-fusion --no-rope-fusion --no-masked-softmax-fusion --no-bias-dropout-fusion "
    "--no-persist-layer-norm --num-workers 0 --log-interval 1 --attention-backend unfused"
).split()
# run -> its flags beside COMMON (4 ranks each: what is not model parallel is data parallel).
# ---------------------------------------------------------------- device plumbing (CPU for CUDA)


def _cpu_plumbing() -> None:
    """Answer megatron's CUDA calls on the CPU (the module docstring lists them)."""
    import torch
    from torch.overrides import TorchFunctionMode

    cuda = torch.cuda
    for name, value in {
        "is_available": lambda: True, "device_count": lambda: 1, "set_device": lambda *a: None,
        "current_device": lambda: 0, "synchronize": lambda *a, **k: None, "empty_cache": lambda: None,
        "get_rng_state": lambda *a, **k: torch.get_rng_state(),
        "set_rng_state": lambda state, *a, **k: torch.set_rng_state(state),
        "manual_seed": lambda seed: None, "manual_seed_all": lambda seed: None,
        "memory_allocated": lambda *a: 0, "max_memory_allocated": lambda *a: 0, "memory_reserved": lambda *a: 0,
        "max_memory_reserved": lambda *a: 0, "memory_stats": lambda *a: {}, "reset_peak_memory_stats": lambda *a: None,
        "get_device_properties": lambda *a: types.SimpleNamespace(name="cpu", total_memory=0, major=9, minor=0),
        "get_device_capability": lambda *a: (9, 0), "current_stream": lambda *a: _Stream(),
        "default_stream": lambda *a: _Stream(), "Stream": _Stream, "Event": _Event, "stream": _stream,
    }.items():  # fmt: skip
        setattr(cuda, name, value)
    cuda.random.get_rng_state, cuda.random.set_rng_state = cuda.get_rng_state, cuda.set_rng_state
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.nn.Module.cuda = lambda self, *a, **k: self

    class OnCpu(TorchFunctionMode):
        """Tensors asked for on ``cuda`` (or device 0) are made on the CPU."""

        def __torch_function__(self, func, types_, args=(), kwargs=None):
            kwargs = kwargs or {}
            device = kwargs.get("device")
            if device is not None and (isinstance(device, int) or "cuda" in str(device)):
                kwargs["device"] = "cpu"
            if func in (torch.Tensor.to,) and args and any("cuda" in str(a) for a in args[1:]):
                args = (args[0], *("cpu" if "cuda" in str(a) else a for a in args[1:]))
            return func(*args, **kwargs)

    OnCpu().__enter__()
    if not hasattr(typing, "override"):  # Python 3.12's; megatron.training imports it
        typing.override = lambda f: f


class _Stream:
    def wait_stream(self, *a) -> None: ...
    def wait_event(self, *a) -> None: ...
    def synchronize(self) -> None: ...
    def record_event(self, *a):
        return _Event()


class _Event:
    def __init__(self, *a, **k) -> None: ...
    def record(self, *a) -> None: ...
    def wait(self, *a) -> None: ...
    def synchronize(self) -> None: ...
    def query(self) -> bool:
        return True


@contextlib.contextmanager
def _stream(*a):
    yield


def _import_megatron() -> None:
    with without_triton():
        import megatron.core
        import megatron.training  # noqa: F401
    from megatron.training import initialize

    initialize._warmup_jit_function = lambda *a, **k: None
    initialize._compile_dependencies = lambda: None  # the wheel ships the dataset helpers built


def forward_step(data_iterator, model):
    """pretrain_gpt.py's forward_step for these flags: the batch (tensor-parallel rank 0 reads it,
    the others get it by broadcast), the model's per-token loss, the masked sum as the loss."""
    from megatron.core import mpu
    from megatron.core.utils import get_batch_on_this_tp_rank
    from megatron.training import get_args

    args, tp_rank = get_args(), mpu.get_tensor_model_parallel_rank()
    batch = get_batch_on_this_tp_rank(
        next(data_iterator) if tp_rank == 0 else {}, has_cu_seqlens=False, is_hybrid_cp=False,
        create_attention_mask_in_dataloader=True, broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(), cp_size=1, tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size, seq_length=args.seq_length, mtp_on_this_rank=False,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(), is_pipeline_last_stage=mpu.is_pipeline_last_stage(),
    )  # fmt: skip
    out = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    return out, partial(_loss, batch["loss_mask"])


def _loss(loss_mask, output_tensor):
    import torch

    losses, mask = output_tensor.view(-1).float(), loss_mask.view(-1).float()
    loss, tokens = torch.sum(losses * mask), mask.sum().detach().to(torch.int)
    return loss, tokens, {"lm loss": torch.cat([loss.detach().view(1), tokens.view(1)])}


def datasets_provider(num_samples, vp_stage=None):
    """pretrain_gpt.py's train_valid_test_datasets_provider for ``--mock-data``."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training import get_args
    from megatron.training.utils import is_first_or_last_pipeline_stage

    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=None, blend_per_split=None, split=args.split,
        path_to_cache=None, tokenizer=build_tokenizer(args), reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, create_attention_mask=True, mid_level_dataset_surplus=args.mid_level_dataset_surplus,
    )  # fmt: skip

    def built_here() -> bool:
        from megatron.core import mpu

        return mpu.get_tensor_model_parallel_rank() == 0 and is_first_or_last_pipeline_stage(vp_stage)

    return BlendedMegatronDatasetBuilder(MockGPTDataset, num_samples, built_here, config).build()


datasets_provider.is_distributed = True  # as pretrain_gpt.py marks it


def get_embedding_ranks(pp_ranks):
    """pretrain_gpt.py's: the first stage, and the last where the head is tied to the embedding."""
    from megatron.training import get_args

    ranks = [pp_ranks[0]]
    if len(pp_ranks) > 1 and not get_args().untie_embeddings_and_output_weights:
        ranks.append(pp_ranks[-1])
    return sorted(set(ranks))


def _args(flags: list[str]):
    from megatron.training.arguments import parse_and_validate_args

    sys.argv = ["pretrain_gpt.py", *flags]
    return parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})


def reset() -> None:
    """Megatron's process-wide state, cleared between two runs in one process."""
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
    from megatron.core.rerun_state_machine import destroy_rerun_state_machine
    from megatron.training.global_vars import destroy_global_vars

    parallel_state.destroy_model_parallel()
    destroy_num_microbatches_calculator()
    destroy_rerun_state_machine()
    destroy_global_vars()


def start() -> None:
    """This process made ready for megatron on the CPU: the plumbing, megatron imported, the gloo group."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    _cpu_plumbing()
    _import_megatron()
    dist.init_process_group("gloo")  # before initialize_megatron, which would ask for NCCL


def train(flags: list[str], save: Path) -> None:
    """One step of ``pretrain_gpt.py`` with COMMON and ``flags``, saved under ``save``."""
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args

    args = _args([*COMMON, *flags, "--save", str(save)])
    config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    pretrain(config, datasets_provider, ModelType.encoder_or_decoder, forward_step,
             get_embedding_ranks=get_embedding_ranks)  # fmt: skip
    reset()


def load_whole(flags: list[str], step: Path):
    """The model of COMMON and ``flags`` at TP=1/PP=1/EP=1 on every rank (each rank data parallel), with
    megatron-core's own ``dist_checkpointing.load`` of the saved ``step`` in it (reset() after use)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.models.gpt import GPTModelBuilder

    flags = [*COMMON, *flags]
    for parallel in ("--pipeline-model-parallel-size", "--tensor-model-parallel-size", "--expert-model-parallel-size"):
        if parallel in flags:
            flags[flags.index(parallel) + 1] = "1"
    flags += ["--global-batch-size", str(dist.get_world_size())]  # every rank data parallel now
    if "--decoder-first-pipeline-num-layers" in flags:
        at = flags.index("--decoder-first-pipeline-num-layers")
        del flags[at : at + 2]
    args = _args(flags)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(args.seed)
    model_config = gpt_config_from_args(args)
    model_config.finalize()
    model = GPTModelBuilder(model_config).build_model(pg_collection=None, pre_process=True, post_process=True)
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(step))
    missing = [k for k in model.load_state_dict(state["model"], strict=False).missing_keys if "_extra_state" not in k]
    assert not missing, missing
    return model.eval()
