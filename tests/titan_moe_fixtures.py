"""Qwen3-MoE steps written by torchtitan 0.3.0's own CheckpointManager, on CPU/gloo, 2 ranks.

``python tests/titan_moe_fixtures.py ROOT`` builds torchtitan's Qwen3-MoE with its own layer
builder (``_build_qwen3_moe_layers``: every layer MoE, load balancing on, as torchtitan's
Qwen3-MoE configs have it), shards it with ``fully_shard`` over 2 gloo ranks (the experts'
grouped weights ``w1_EFD``/``w3_EFD``/``w2_EDF`` split on their expert axis), takes one
optimizer step with torchtitan's ``OptimizersContainer`` and saves with
``CheckpointManager.save`` into ``ROOT/<case>/checkpoint/step-1/``. Cases:

* ``qwen3_moe``: the routing bias ``expert_bias_E`` saved as initialised (zeros);
* ``qwen3_moe_biased``: a forward pass counts tokens per expert and torchtitan's own
  ``register_moe_load_balancing_hook`` updates ``expert_bias_E`` at the optimizer step, as in
  training: a nonzero bias that Hugging Face's Qwen3-MoE has no place for;
* ``qwen3_moe_ep2``: expert parallel, EP=2 (and FSDP 2 for the rest) through torchtitan's own
  ``parallelize_qwen3`` with ``ParallelDims``: each rank holds two of the four experts.

Beside each: ``config.json`` (the Hugging Face Qwen3-MoE config a user would write) and
``to_hf.safetensors``, torchtitan's convert_to_hf route: ``dcp.load`` into the model's state
dict, then ``Qwen3StateDictAdapter.to_hf`` (which drops ``expert_bias_E``).

Patches, all outside checkpointing (see ../shared/producers-on-cpu.md): a stand-in ``triton``
while torchtitan imports (bench/standins.py); random gradients instead of a backward pass
(FlexAttention has no backward on CPU); torchtitan's ``device_type`` set to ``cpu`` for the
meshes ParallelDims builds; ``spmd_backend="partial_dtensor"`` for EP (the default asks for
every parameter as a DTensor on the full mesh first) and fp32 parameters (the default mixed
precision is bf16 at run time; the saved weights are fp32 either way).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from standins import without_triton

WORLD = 2
SEQ = 12
# dim, n_heads, n_kv_heads, head_dim, moe_hidden, experts, top_k, layers, vocab
DIMS = (32, 4, 2, 8, 24, 4, 2, 2, 128)
# case -> (load-balancing bias updated, expert parallel)
CASES = {"qwen3_moe": (False, False), "qwen3_moe_biased": (True, False), "qwen3_moe_ep2": (False, True)}


def import_torchtitan() -> None:
    with without_triton():
        import torchtitan.components.checkpoint
        import torchtitan.models.qwen3  # noqa: F401


def model_config():
    """torchtitan's Qwen3-MoE config for DIMS, built by torchtitan's own builders."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_moe_layers

    dim, nh, nkv, hd, moe_hidden, experts, top_k, layers, vocab = DIMS
    rope = CosSinRoPE.Config(dim=hd, max_seq_len=64, theta=1000000.0)
    blocks = _build_qwen3_moe_layers(
        n_layers=layers, dim=dim, n_heads=nh, n_kv_heads=nkv, head_dim=hd, moe_hidden_dim=moe_hidden,
        num_experts=experts, top_k=top_k, attn_backend="flex", moe_comm_backend="standard", rope=rope,
    )  # fmt: skip
    return Qwen3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init={"weight": _normal}),
        norm=RMSNorm.Config(normalized_shape=dim, eps=1e-6, param_init={"weight": _normal}),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init={"weight": _normal}),
        layers=blocks,
        enable_weight_tying=False,
    )


def _normal(w):
    import torch

    with torch.no_grad():
        return w.normal_(0.0, 0.3).add_(1.0) if w.dim() == 1 else w.normal_(0.0, 0.1)


def hf_config() -> dict:
    from transformers import Qwen3MoeConfig

    dim, nh, nkv, hd, moe_hidden, experts, top_k, layers, vocab = DIMS
    config = Qwen3MoeConfig(
        hidden_size=dim, num_attention_heads=nh, num_key_value_heads=nkv, head_dim=hd, intermediate_size=64,
        moe_intermediate_size=moe_hidden, num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True,
        num_hidden_layers=layers, vocab_size=vocab, tie_word_embeddings=False, max_position_embeddings=64,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )  # fmt: skip
    config.architectures = ["Qwen3MoeForCausalLM"]
    return config.to_dict()


class _Stateful:
    def __init__(self, state: dict):
        self.state = state

    def state_dict(self) -> dict:
        return dict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = dict(state)


def train_and_save(model, out: Path, rank: int, parallel=None, balance=None) -> None:
    """What torchtitan's trainer does to a built model, as a checkpoint sees it: FSDP2 over the
    layers (or ``parallel(model)``: expert parallelism), one AdamW step on random gradients
    (after ``balance(model, optimizers)``, its load-balancing hook), and its CheckpointManager's save."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    if parallel is not None:
        parallel(model)
    else:
        mesh = init_device_mesh("cpu", (WORLD,))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    adamw = ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})
    optimizers = OptimizersContainer.Config(param_groups=[adamw], implementation="for-loop").build(model_parts=[model])
    if balance is not None:
        balance(model, optimizers)
    torch.manual_seed(1 + rank)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 0.1
    optimizers.step()
    ckpt = CheckpointManager(
        CheckpointManager.Config(enable=True, folder="checkpoint", interval=1, keep_latest_k=0),
        dataloader=_Stateful({"epoch": 0, "sample": 24}),
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=None,
        states={"train_state": _Stateful({"step": 1})},
        sd_adapter=None,
        base_folder=str(out),
    )
    ckpt.save(curr_step=1)
    ckpt.close()


def _save_one(name: str, biased: bool, ep: bool, root: Path, rank: int) -> None:
    import torch

    out = root / name
    torch.manual_seed(0)
    config = model_config()
    if ep:  # what the trainer's update_from_config does for expert_parallel_degree > 1
        from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

        set_qwen3_sharding_config(config, enable_sp=False, enable_ep=True)
    model = config.build()
    model.init_weights(buffer_device=None)
    train_and_save(
        model, out, rank, (lambda m: _expert_parallel(m, root)) if ep else None, _load_balancing if biased else None
    )
    if rank == 0:
        (out / "config.json").write_text(json.dumps(hf_config(), indent=2))


def _expert_parallel(model, root: Path) -> None:
    """torchtitan's own parallelize_qwen3 with EP = FSDP = 2 on the 2 ranks."""
    from torchtitan.models.qwen3.parallelize import parallelize_qwen3

    expert_parallel(model, root, parallelize_qwen3)


def expert_parallel(model, root: Path, parallelize) -> None:
    """A model family's own ``parallelize`` (torchtitan's) with EP = FSDP = 2 on the 2 ranks."""
    import torchtitan.distributed.parallel_dims as pd
    from torchtitan.config.configs import CompileConfig, ParallelismConfig, TrainingConfig

    pd.device_type = "cpu"
    par = ParallelismConfig(expert_parallel_degree=WORLD, data_parallel_shard_degree=WORLD)
    par.spmd_backend = "partial_dtensor"
    dims = pd.ParallelDims.from_config(par, WORLD)
    dims.build_mesh()
    training = TrainingConfig()
    training.mixed_precision_param = "float32"
    parallelize(
        model, parallel_dims=dims, training=training, parallelism=par, compile_config=CompileConfig(),
        ac_config=None, dump_folder=str(root),
    )  # fmt: skip


def _load_balancing(model, optimizers) -> None:
    import torch

    load_balancing(model, optimizers, torch.randint(0, DIMS[-1], (2, SEQ), generator=torch.Generator().manual_seed(7)))


def load_balancing(model, optimizers, tokens) -> None:
    """torchtitan's own load-balancing hook on the optimizer, after a forward pass of ``tokens``
    has counted the tokens each expert got: the step updates ``expert_bias_E`` as training does."""
    import torch
    import torchtitan.distributed.parallel_dims as pd
    from torchtitan.components.optimizer.optimizer import register_moe_load_balancing_hook

    pd.device_type = "cpu"  # torchtitan's meshes are on "cuda" unless told
    dims = pd.ParallelDims(dp_replicate=1, dp_shard=WORLD, cp=1, tp=1, pp=1, ep=1, world_size=WORLD)
    dims.build_mesh()
    register_moe_load_balancing_hook(optimizers, [model], dims)
    positions = torch.arange(tokens.shape[1]).repeat(tokens.shape[0], 1)
    with torch.no_grad():
        model(tokens, positions, model.get_attention_masks(positions=positions))


def convert_to_hf(step: Path, out: Path) -> None:
    """torchtitan's convert_to_hf route: dcp.load into the model's state dict, then to_hf."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torchtitan.components.checkpointer import ModelWrapper
    from torchtitan.models.qwen3 import Qwen3StateDictAdapter

    config = model_config()
    with torch.device("cpu"):
        model = config.build()
    state = ModelWrapper(model)._get_state_dict()
    dcp.load(state, checkpoint_id=str(step))
    hf = Qwen3StateDictAdapter(config, None).to_hf(state)
    save_file({k: v.contiguous() for k, v in hf.items()}, str(out))


def _worker(rank: int, root: str, store: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    import_torchtitan()
    dist.init_process_group("gloo", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD)
    try:
        for name, (biased, ep) in CASES.items():
            _save_one(name, biased, ep, Path(root), rank)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def make(root: Path) -> dict[str, Path]:
    import torch.multiprocessing as mp

    root.mkdir(parents=True, exist_ok=True)
    store = root / "store"
    store.unlink(missing_ok=True)
    mp.start_processes(_worker, args=(str(root), str(store)), nprocs=WORLD, start_method="spawn")
    store.unlink(missing_ok=True)
    import_torchtitan()
    for name in CASES:
        convert_to_hf(root / name / "checkpoint" / "step-1", root / name / "to_hf.safetensors")
    return {name: root / name for name in CASES}


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(json.dumps({k: str(v) for k, v in make(Path(sys.argv[1])).items()}))
