"""Bench checkpoints from the trainers' own code, and their own converters as anchors.

    python bench/trainer_ckpt.py titan ROOT PARAMS      # torchtitan 0.3.0 step (FSDP2, 2 gloo ranks)
    python bench/trainer_ckpt.py megatron ROOT PARAMS   # megatron-core 0.19.2 torch_dist (TP=2)
    python bench/trainer_ckpt.py convert_to_hf STEP DIMS OUT    # torchtitan's convert_to_hf.py route
    python bench/trainer_ckpt.py megatron_load RUN DIMS OUT     # load the whole model, split, save

The checkpoints are written by bench/titan_ckpt.py and bench/megatron_ckpt.py (the trainers'
own checkpointing code, which the tests' fixtures run too) at a size near PARAMS parameters (F32).
``convert_to_hf`` does what torchtitan's scripts/checkpoint_conversion/convert_to_hf.py does:
build the model, ``dcp.load`` the step into its state dict, the model's StateDictAdapter
``to_hf``, and ``dcp.save`` through torch's ``HuggingFaceStorageWriter`` with consolidation
(one ``model.safetensors``; the script leaves its ``sharded/`` copy beside it).
``megatron_load`` is the route Megatron-Bridge's export takes: the whole model loaded by
megatron-core (``dist_checkpointing.load`` into a TP=1 GPTModel), q/k/v split per query
group and gate/up from the loaded tensors, ``save_file``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def titan_dims(params: int) -> tuple:
    """A Llama 3 of about ``params`` parameters (at least one layer): width 512 (8 heads, 4 KV
    heads), the embedding and head about 80% of it, as in a small model (vocab up to 32k)."""
    dim, hidden = 512, 1536
    vocab = max(256, min(32000, int(params * 0.8) // (2 * dim)) // 128 * 128)
    per_layer = dim * dim * 2 + dim * 256 * 2 + 3 * dim * hidden
    layers = max(1, round((params - 2 * vocab * dim) / per_layer))
    return ("llama3", dim, 8, 4, 64, hidden, layers, vocab, False)


def megatron_dims(params: int) -> tuple:
    """A GPTModel of about ``params`` parameters, the same shape as titan_dims (vocab padded to 32000)."""
    _, dim, nh, nkv, hd, hidden, layers, vocab, _ = titan_dims(params)
    return (layers, dim, nh, nkv, hd, hidden, vocab - 100, vocab, False, False, False, False)


def convert_to_hf(step: Path, dims: tuple, out: Path) -> None:
    import titan_ckpt
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    titan_ckpt.import_torchtitan()
    from torchtitan.components.checkpointer import ModelWrapper

    with torch.inference_mode():
        config = titan_ckpt.model_config(dims)
        with torch.device("cpu"):
            model = config.build()
        adapter = titan_ckpt._adapter(dims[0])(config, None)
        state = ModelWrapper(model)._get_state_dict()
        dcp.load(state, checkpoint_id=str(step))
        hf = adapter.to_hf(state)
        writer = HuggingFaceStorageWriter(
            path=str(out), save_distributed=True, fqn_to_index_mapping=adapter.fqn_to_index_mapping,
            enable_consolidation=True, thread_count_consolidation=5,
        )  # fmt: skip
        dcp.save(hf, storage_writer=writer, no_dist=True)


def megatron_load(run: Path, dims: tuple, out: Path) -> None:
    """megatron-core's own load of the whole model at TP=1, then the Bridge's split, then save_file."""
    import megatron_ckpt as mf
    import torch.distributed as dist
    from safetensors.torch import save_file

    mf._cuda_stand_ins()
    mf._import_megatron()
    from megatron.core import dist_checkpointing

    store = out.parent / "store-load"
    store.unlink(missing_ok=True)
    dist.init_process_group("gloo", store=dist.FileStore(str(store), 1), rank=0, world_size=1)
    mf._parallel(1)
    layers, hidden, heads, groups, kv, ffn, vocab, *_ = dims
    model = mf.build(dims, 1)
    step = run / f"iter_{mf.ITERATION:07d}"
    model.load_state_dict(dist_checkpointing.load({"model": model.sharded_state_dict()}, str(step))["model"])
    m = model.state_dict()
    hpg = heads // groups
    sd = {
        "model.embed_tokens.weight": m["embedding.word_embeddings.weight"][:vocab],
        "model.norm.weight": m["decoder.final_layernorm.weight"],
        "lm_head.weight": m["output_layer.weight"][:vocab],
    }
    for i in range(layers):
        p, q = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = m[p + "self_attention.linear_qkv.weight"].view(groups, hpg + 2, kv, hidden)
        sd[q + "self_attn.q_proj.weight"] = qkv[:, :hpg].reshape(-1, hidden)
        sd[q + "self_attn.k_proj.weight"] = qkv[:, hpg].reshape(-1, hidden)
        sd[q + "self_attn.v_proj.weight"] = qkv[:, hpg + 1].reshape(-1, hidden)
        sd[q + "self_attn.o_proj.weight"] = m[p + "self_attention.linear_proj.weight"]
        fc1 = m[p + "mlp.linear_fc1.weight"]
        sd[q + "mlp.gate_proj.weight"], sd[q + "mlp.up_proj.weight"] = fc1[:ffn], fc1[ffn:]
        sd[q + "mlp.down_proj.weight"] = m[p + "mlp.linear_fc2.weight"]
        sd[q + "input_layernorm.weight"] = m[p + "input_layernorm.weight"]
        sd[q + "post_attention_layernorm.weight"] = m[p + "pre_mlp_layernorm.weight"]
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"))
    dist.destroy_process_group()
    store.unlink(missing_ok=True)


def main() -> None:
    what, root = sys.argv[1], Path(sys.argv[2])
    if what == "titan":
        import titan_ckpt

        dims = titan_dims(int(sys.argv[3]))
        titan_ckpt.save_steps(root, {"bench": dims})
        print(json.dumps(dims))
    elif what == "megatron":
        import megatron_ckpt

        dims = megatron_dims(int(sys.argv[3]))
        megatron_ckpt.save_runs(root, {"bench": dims}, read_back=False)
        print(json.dumps(dims))
    elif what == "convert_to_hf":
        convert_to_hf(root, tuple(json.loads(sys.argv[3])), Path(sys.argv[4]))
    elif what == "megatron_load":
        megatron_load(root, tuple(json.loads(sys.argv[3])), Path(sys.argv[4]))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
