"""Bench checkpoints from the trainers' own code, and their own converters as anchors.

    python bench/trainer_ckpt.py titan ROOT PARAMS      # torchtitan 0.3.0 step (FSDP2, 2 gloo ranks)
    python bench/trainer_ckpt.py convert_to_hf STEP DIMS OUT    # torchtitan's convert_to_hf.py route

The checkpoints are written by bench/titan_ckpt.py (the trainer's own checkpointing code, which the
tests' fixtures run too) at a size near PARAMS parameters (F32); the Megatron one by
bench/megatron_train.py (Megatron-LM's own training loop), at ``megatron_dims``.
``convert_to_hf`` does what torchtitan's scripts/checkpoint_conversion/convert_to_hf.py does:
build the model, ``dcp.load`` the step into its state dict, the model's StateDictAdapter
``to_hf``, and ``dcp.save`` through torch's ``HuggingFaceStorageWriter`` with consolidation
(one ``model.safetensors``; the script leaves its ``sharded/`` copy beside it).
``hf_state`` is the split Megatron-Bridge's export makes of megatron-core's whole TP=1 model:
q/k/v per query group and gate/up from the loaded tensors (bench/megatron_train.py ``load``).
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


def hf_state(m: dict, dims: tuple) -> dict:
    """The Hugging Face tensors of a TP=1 GPTModel's state dict ``m`` (the Bridge's split): q/k/v per
    query group out of ``linear_qkv``, gate/up out of ``linear_fc1``, the vocabulary trimmed."""
    layers, hidden, heads, groups, kv, ffn, vocab, *_ = dims
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
    return sd


def main() -> None:
    what, root = sys.argv[1], Path(sys.argv[2])
    if what == "titan":
        import titan_ckpt

        dims = titan_dims(int(sys.argv[3]))
        titan_ckpt.save_steps(root, {"bench": dims})
        print(json.dumps(dims))
    elif what == "convert_to_hf":
        convert_to_hf(root, tuple(json.loads(sys.argv[3])), Path(sys.argv[4]))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
