"""Checkpoints written by torchtitan 0.3.0's own CheckpointManager, on CPU/gloo, 2 ranks, FSDP2.

``python bench/titan_ckpt.py ROOT`` (run in a child: torchtitan imports torch's
compiler stack) builds each model of MODELS with torchtitan's own layer builders, shards
it with ``fully_shard`` over 2 gloo ranks, takes one optimizer step with torchtitan's
``OptimizersContainer`` and ``LRSchedulersContainer``, and saves with
``CheckpointManager.save`` into ``ROOT/<name>/checkpoint/step-1/``: model keys at the top
level, ``optimizer.state.*``, ``lr_scheduler``, ``dataloader`` and ``train_state``.

Beside each: ``config.json`` (the Hugging Face config a user would write for the model),
``oracle.pt`` (token ids and the logits of the trainer's sharded model on them) and
``convert_to_hf.safetensors`` (what torchtitan's ``convert_to_hf.py`` does: the model's
state dict loaded back with ``dcp.load`` through torchtitan's own reader, then its
``StateDictAdapter.to_hf``).

``ROOT/llama3_v02/``: the ``llama3`` model under torchtitan 0.2's names (``attention.wq``,
``output.weight``), saved by ``dcp.save`` from one process as 0.2's checkpointer lays it out
(model keys at the top level); torchtitan 0.2 itself does not run on this torch.

Patches, all outside checkpointing: a stand-in ``triton`` while torchtitan imports (its
expert-parallel kernels import it at module level; nothing here runs them), and random
gradients instead of a backward pass (FlexAttention has no backward on CPU).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from standins import without_triton

WORLD = 2
SEQ = 12
# name -> (family, dim, n_heads, n_kv_heads, head_dim, hidden, layers, vocab, tied)
MODELS = {
    "llama3": ("llama3", 64, 4, 2, 16, 96, 2, 256, False),
    "llama3_tied": ("llama3", 48, 6, 3, 8, 80, 2, 200, True),
    "qwen3": ("qwen3", 64, 4, 2, 32, 96, 2, 256, True),
}


def import_torchtitan() -> None:
    """Import torchtitan's models and checkpointer (see standins.without_triton)."""
    with without_triton():
        import torchtitan.components.checkpoint
        import torchtitan.models.llama3
        import torchtitan.models.qwen3  # noqa: F401


def model_config(dims: tuple):
    """torchtitan's model config for ``dims`` (a MODELS value), built by torchtitan's own layer builders."""
    from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm

    family, dim, nh, nkv, hd, hidden, layers, vocab, tied = dims
    embed = Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init={"weight": _normal})
    head = Linear.Config(in_features=dim, out_features=vocab, param_init={"weight": _normal})
    if family == "llama3":
        from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers

        rope = ComplexRoPE.Config(dim=hd, max_seq_len=64, theta=500000.0, scaling="none")
        blocks = _build_llama3_layers(
            n_layers=layers, dim=dim, n_heads=nh, n_kv_heads=nkv, hidden_dim=hidden, rope=rope, attn_backend="flex"
        )
        norm = RMSNorm.Config(normalized_shape=dim, param_init={"weight": _normal})
        cls = Llama3Model
    else:
        from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_layers

        rope = CosSinRoPE.Config(dim=hd, max_seq_len=64, theta=1000000.0)
        blocks = _build_qwen3_layers(
            n_layers=layers,
            dim=dim,
            n_heads=nh,
            n_kv_heads=nkv,
            head_dim=hd,
            hidden_dim=hidden,
            rope=rope,
            attn_backend="flex",
        )
        norm = RMSNorm.Config(normalized_shape=dim, eps=1e-6, param_init={"weight": _normal})
        cls = Qwen3Model
    return cls.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=embed,
        norm=norm,
        lm_head=head,
        layers=blocks,
        enable_weight_tying=tied,
    )


def _normal(w):
    """Norm weights too are random, so a swapped or unpermuted tensor shows in the logits."""
    import torch

    with torch.no_grad():
        return w.normal_(0.0, 0.3).add_(1.0) if w.dim() == 1 else w.normal_(0.0, 0.1)


def hf_config(dims: tuple) -> dict:
    """The Hugging Face config.json of ``dims`` (a MODELS value), as transformers writes it."""
    from transformers import LlamaConfig, Qwen3Config

    family, dim, nh, nkv, hd, hidden, layers, vocab, tied = dims
    common = dict(
        hidden_size=dim,
        num_attention_heads=nh,
        num_key_value_heads=nkv,
        head_dim=hd,
        intermediate_size=hidden,
        num_hidden_layers=layers,
        vocab_size=vocab,
        tie_word_embeddings=tied,
        max_position_embeddings=64,
    )
    if family == "llama3":
        config = LlamaConfig(**common, rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    else:
        config = Qwen3Config(**common, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    return config.to_dict()


class _Stateful:
    """The trainer's train_state and a dataloader's: what they save, here fixed values."""

    def __init__(self, state: dict):
        self.state = state

    def state_dict(self) -> dict:
        return dict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = dict(state)


def _save_one(name: str, dims: tuple, root: Path, rank: int) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    out = root / name
    torch.manual_seed(0)  # the same initial weights on both ranks before sharding
    config = model_config(dims)
    model = config.build()
    model.init_weights(buffer_device=None)
    mesh = init_device_mesh("cpu", (WORLD,))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    adamw = ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})
    optimizers = OptimizersContainer.Config(param_groups=[adamw], implementation="for-loop").build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config().build(optimizers=optimizers, training_steps=10)
    torch.manual_seed(1 + rank)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 0.1
    optimizers.step()
    schedulers.step()
    ckpt = CheckpointManager(
        CheckpointManager.Config(enable=True, folder="checkpoint", interval=1, keep_latest_k=0),
        dataloader=_Stateful({"epoch": 0, "sample": 24}),
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": _Stateful({"step": 1, "ntokens_seen": 48})},
        sd_adapter=None,
        base_folder=str(out),
    )
    ckpt.save(curr_step=1)
    ckpt.close()
    tokens = torch.randint(0, config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(7))
    positions = torch.arange(SEQ).repeat(2, 1)
    with torch.no_grad():
        logits = model(tokens, positions, model.get_attention_masks(positions=positions))
    if rank == 0:
        (out / "config.json").write_text(json.dumps(hf_config(dims), indent=2))
        torch.save(
            {"tokens": tokens, "logits": logits.full_tensor() if hasattr(logits, "full_tensor") else logits},
            out / "oracle.pt",
        )


def convert_to_hf(dims: tuple, step: Path, out: Path) -> None:
    """torchtitan's convert_to_hf.py with this model config: dcp.load into the model's state
    dict (as torchtitan's dcp_load does), then the model's StateDictAdapter.to_hf, saved with
    safetensors (the script saves with torch's HF writer: the same tensors)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torchtitan.components.checkpointer import ModelWrapper

    config = model_config(dims)
    with torch.device("cpu"):
        model = config.build()
    adapter = _adapter(dims[0])(config, None)
    state = ModelWrapper(model)._get_state_dict()
    dcp.load(state, checkpoint_id=str(step))  # as CheckpointManager.dcp_load does
    save_file({k: v.contiguous() for k, v in adapter.to_hf(state).items()}, str(out))


def _adapter(family: str):
    """The family's StateDictAdapter class (its ModelSpec's ``state_dict_adapter``)."""
    if family == "llama3":
        from torchtitan.models.llama3 import Llama3StateDictAdapter

        return Llama3StateDictAdapter
    from torchtitan.models.qwen3 import Qwen3StateDictAdapter

    return Qwen3StateDictAdapter


V02_NAMES = {".attention.qkv_linear.": ".attention.", "lm_head.weight": "output.weight"}


def save_v02(step: Path, out: Path) -> None:
    """The model tensors of ``step`` (a llama3 save) under torchtitan 0.2's names, with dcp.save."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = step.parent / "whole.pt"
    dcp_to_torch_save(str(step), str(whole))
    import torch

    state = torch.load(whole, weights_only=False)
    model = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and not k.startswith("optimizer")}
    for old, new in V02_NAMES.items():
        model = {k.replace(old, new): v for k, v in model.items()}
    dcp.save(model, storage_writer=dcp.FileSystemWriter(str(out)), no_dist=True)
    whole.unlink()


def _worker(rank: int, root: str, store: str, models: dict) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    import_torchtitan()
    dist.init_process_group("gloo", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD)
    try:
        for name, dims in models.items():
            _save_one(name, dims, Path(root), rank)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def save_steps(root: Path, models: dict) -> None:
    """Each of ``models`` (name -> dims) trained a step and saved by 2 ranks under ``root/<name>/``."""
    import torch.multiprocessing as mp

    root.mkdir(parents=True, exist_ok=True)
    store = root / "store"
    store.unlink(missing_ok=True)
    mp.start_processes(_worker, args=(str(root), str(store), models), nprocs=WORLD, start_method="spawn")
    store.unlink(missing_ok=True)


def make(root: Path) -> dict[str, Path]:
    """Write every model of MODELS under ``root`` (see the module docstring); name -> its folder."""
    save_steps(root, MODELS)
    import_torchtitan()
    for name in MODELS:
        convert_to_hf(MODELS[name], root / name / "checkpoint" / "step-1", root / name / "convert_to_hf.safetensors")
    v02 = root / "llama3_v02"
    save_v02(root / "llama3" / "checkpoint" / "step-1", v02 / "checkpoint" / "step-1")
    for f in ("config.json", "oracle.pt", "convert_to_hf.safetensors"):
        (v02 / f).write_bytes((root / "llama3" / f).read_bytes())
    return {name: root / name for name in [*MODELS, "llama3_v02"]}


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(json.dumps({k: str(v) for k, v in make(Path(sys.argv[1])).items()}))
