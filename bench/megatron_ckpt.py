"""Checkpoints written by megatron-core 0.19.2's own ``dist_checkpointing.save`` (``torch_dist``),
GPTModel at tensor parallel 2 on 2 gloo ranks, CPU.

``python bench/megatron_ckpt.py ROOT`` (in a child, megatron-core on the path) builds
each model of MODELS with megatron-core's local layer spec (its norms saved under TE's
names, ``linear_qkv.layer_norm_weight``), saves ``{"model": sharded_state_dict, "args":
Namespace, "iteration": N, "checkpoint_version": 3.0}`` into ``ROOT/<name>/iter_0000010/``
and writes ``latest_checkpointed_iteration.txt``, as Megatron's training loop does (its
``megatron.training`` is not part of megatron-core: ``args`` carries the fields of its
argument parser that describe the model).

Beside each: ``config.json`` (the Hugging Face config of the model, transformers' own),
``oracle.pt`` (token ids and the logits of Megatron's own TP=2 forward) and
``full.safetensors`` (the checkpoint read back by ``dist_checkpointing.load`` into a TP=1
model in one process: megatron-core's own reader, per-layer names).

``save_step``, ``write_beside``, ``fixed_tokens`` and ``forward`` are the steps every megatron-core
fixture script shares (tests/megatron_moe_fixtures.py, tests/megatron_dsv3_fixtures.py): a run laid
out as the training loop lays it out, and the oracle's forward.

Stand-ins, all outside checkpointing: ``triton`` at import (bench/standins.py),
``torch.cuda.synchronize`` (a no-op) and ``torch.cuda.current_device`` (``"cpu"``), which
megatron-core's save path calls unconditionally, and ``torch.cuda.get_rng_state`` /
``set_rng_state`` (the CPU generator's), which its model-parallel RNG tracker calls.
"""

from __future__ import annotations

import json
import os
import sys
from argparse import Namespace
from pathlib import Path

from standins import without_triton

WORLD = 2
ITERATION = 10
SEQ = 12
# name -> (layers, hidden, heads, groups, kv_channels, ffn, vocab, padded vocab, qkv bias, tied,
#          RoPE on interleaved pairs, q/k norms)
MODELS = {
    "gpt": (2, 64, 4, 2, 16, 96, 250, 256, False, False, False, False),
    "gpt_bias": (2, 48, 8, 2, 6, 80, 200, 256, True, True, False, False),
    "gpt_qk": (2, 64, 4, 4, 8, 96, 256, 256, False, False, True, True),
}


def _cuda_stand_ins() -> None:
    import torch

    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.get_rng_state = torch.cuda.random.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)


def _import_megatron() -> None:
    with without_triton():
        import megatron.core  # noqa: F401


def _parallel(tp: int) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(123)


def build(dims: tuple, tp: int):
    """megatron-core's GPTModel for ``dims`` (a MODELS value) at tensor parallel ``tp`` (parallel state set)."""
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    layers, hidden, heads, groups, kv, ffn, _, padded, bias, tied, interleaved, qk = dims
    config = TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups, kv_channels=kv,
        ffn_hidden_size=ffn, gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
        layernorm_epsilon=1e-5, add_bias_linear=False, add_qkv_bias=bias, use_cpu_initialization=True,
        tensor_model_parallel_size=tp, init_method_std=0.1, hidden_dropout=0.0, attention_dropout=0.0,
        rotary_interleaved=interleaved, qk_layernorm=qk,
    )  # fmt: skip
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk)
    return GPTModel(
        config, transformer_layer_spec=spec, vocab_size=padded, max_sequence_length=64, parallel_output=False,
        position_embedding_type="rope", rotary_base=10000, share_embeddings_and_output_weights=tied,
    )  # fmt: skip


def args(dims: tuple) -> Namespace:
    """What Megatron's argument parser records for the model (megatron/training/arguments.py names);
    its enums and torch dtypes as they are, so the checkpoint's pickle holds them too."""
    import torch
    from megatron.core.transformer.enums import AttnBackend

    layers, hidden, heads, groups, kv, ffn, vocab, padded, bias, tied, interleaved, qk = dims
    return Namespace(
        num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=heads,
        group_query_attention=True, num_query_groups=groups, kv_channels=kv, padded_vocab_size=padded,
        vocab_size=vocab, make_vocab_size_divisible_by=128, tensor_model_parallel_size=WORLD,
        pipeline_model_parallel_size=1, untie_embeddings_and_output_weights=not tied, swiglu=True,
        normalization="RMSNorm", norm_epsilon=1e-5, add_qkv_bias=bias, add_bias_linear=False,
        position_embedding_type="rope", rotary_base=10000, rotary_interleaved=interleaved, rotary_percent=1.0,
        max_position_embeddings=64, seq_length=SEQ, attention_output_gate=False, qk_layernorm=qk,
        num_experts=None, params_dtype=torch.float32, bf16=False, fp16=False, attention_backend=AttnBackend.auto,
    )  # fmt: skip


def hf_config(dims: tuple) -> dict:
    """The Hugging Face config of the model (Qwen2 for a qkv bias, Qwen3 for q/k norms, else
    Llama), transformers' own."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    layers, hidden, heads, groups, kv, ffn, vocab, _, bias, tied, _, qk = dims
    common = dict(
        hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=groups, head_dim=kv,
        intermediate_size=ffn, num_hidden_layers=layers, vocab_size=vocab, tie_word_embeddings=tied,
        max_position_embeddings=64, rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    )  # fmt: skip
    config = Qwen2Config(**common) if bias else Qwen3Config(**common) if qk else LlamaConfig(**common)
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    return config.to_dict()


def fixed_tokens(vocab: int):
    """The token ids every oracle's forward reads: 2 sequences of SEQ, seeded."""
    import torch

    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(7))


def forward(model, tokens):
    """GPTModel's logits for ``tokens`` [batch, n]: positions 0..n-1, a causal mask."""
    import torch

    batch, n = tokens.shape
    positions = torch.arange(n).repeat(batch, 1)
    mask = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)[None, None]
    return model(tokens, positions, mask)


def save_step(model, saved_args: Namespace, run: Path, rank: int) -> None:
    """``model``'s sharded state dict with ``saved_args`` and the iteration, saved by megatron-core's
    ``dist_checkpointing.save`` into ``run/iter_NNNNNNN/`` beside the run's tracker file, as Megatron's
    training loop lays a run out (every rank calls it)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    step = run / f"iter_{ITERATION:07d}"
    if rank == 0:
        step.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = {"model": model.sharded_state_dict(), "args": saved_args, "iteration": ITERATION,
             "checkpoint_version": 3.0}  # fmt: skip
    dist_checkpointing.save(state, str(step))
    if rank == 0:
        (run / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))


def write_beside(run: Path, rank: int, config: dict, oracle: dict) -> None:
    """On rank 0: the run's Hugging Face ``config.json`` and its ``oracle.pt``."""
    import torch

    if rank == 0:
        (run / "config.json").write_text(json.dumps(config, indent=2))
        torch.save(oracle, run / "oracle.pt")


def _save(name: str, dims: tuple, root: Path, rank: int) -> None:
    import torch

    torch.manual_seed(0)
    model = build(dims, WORLD)
    save_step(model, args(dims), root / name, rank)
    tokens = fixed_tokens(dims[6])
    with torch.no_grad():
        logits = forward(model, tokens)
    write_beside(root / name, rank, hf_config(dims), {"tokens": tokens, "logits": logits[..., : dims[6]]})


def _worker(rank: int, root: str, store: str, models: dict) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    _cuda_stand_ins()
    _import_megatron()
    dist.init_process_group("gloo", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD)
    try:
        _parallel(WORLD)
        for name, dims in models.items():
            _save(name, dims, Path(root), rank)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _reader(rank: int, root: str, store: str, models: dict) -> None:
    """megatron-core's own reader: each checkpoint loaded into a TP=1 model, its state saved whole."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    _cuda_stand_ins()
    _import_megatron()
    from megatron.core import dist_checkpointing

    dist.init_process_group("gloo", store=dist.FileStore(store, 1), rank=0, world_size=1)
    try:
        _parallel(1)
        for name, dims in models.items():
            model = build(dims, 1)
            step = Path(root) / name / f"iter_{ITERATION:07d}"
            loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(step))
            model.load_state_dict(loaded["model"])
            state = model.state_dict().items()
            tensors = {k: v.contiguous() for k, v in state if isinstance(v, torch.Tensor) and "_extra_state" not in k}
            save_file(tensors, str(step.parent / "full.safetensors"))
    finally:
        dist.destroy_process_group()


def save_runs(root: Path, models: dict, read_back: bool = True) -> None:
    """Each of ``models`` (name -> dims) saved at TP=2 under ``root/<name>/`` (and read back at TP=1)."""
    import torch.multiprocessing as mp

    root.mkdir(parents=True, exist_ok=True)
    for fn, world, store in ((_worker, WORLD, "store"), (_reader, 1, "store1"))[: 2 if read_back else 1]:
        (root / store).unlink(missing_ok=True)
        mp.start_processes(fn, args=(str(root), str(root / store), models), nprocs=world, start_method="spawn")
        (root / store).unlink(missing_ok=True)


def make(root: Path) -> dict[str, Path]:
    """Write every model of MODELS under ``root`` (see the module docstring); name -> its run folder."""
    save_runs(root, MODELS)
    return {name: root / name for name in MODELS}


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(json.dumps({k: str(v) for k, v in make(Path(sys.argv[1])).items()}))
