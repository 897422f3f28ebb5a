"""EAGLE-3 draft steps as NeMo Automodel 0.7.0 writes them, built with its own code.

The target config goes through ``AutoConfig`` (transformers 5, as the recipe loads it); the
draft config follows recipes/llm/train_eagle3.py lines 610-658 (0.7.0) exactly; the draft is
``LlamaEagle3DraftModel`` (components/speculative/eagle/draft_llama.py) with its vocab map set
by ``set_vocab_mapping``; config.json is written by the checkpoint addon's
``_save_generated_hf_assets`` (components/checkpoint/addons.py: ``to_json_string(use_diff=False)``)
and the recipe snapshot by ``save_config`` (components/checkpoint/checkpointing.py:
``yaml.dump`` of the raw recipe), as the recipe does at every checkpoint (lines ~1675-1681).
Only the weights are saved with safetensors directly (Automodel's consolidated export writes
the same state-dict keys through DCP, which needs a process group).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# The real configs' keys (meta-llama/Llama-3.1-8B-Instruct, Qwen/Qwen3-8B, as on the hub:
# transformers 4 form), sizes shrunk; num_hidden_layers is the target's own, which the aux
# layer ids index.
TARGETS = {
    "llama3.1": {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": [2, 3, 4],
        "hidden_act": "silu",
        "hidden_size": 16,
        "initializer_range": 0.02,
        "intermediate_size": 40,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 4,
        "num_hidden_layers": 32,
        "num_key_value_heads": 2,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.43.0.dev0",
        "use_cache": True,
        "vocab_size": 50,
    },
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "head_dim": 8,
        "hidden_act": "silu",
        "hidden_size": 16,
        "initializer_range": 0.02,
        "intermediate_size": 48,
        "max_position_embeddings": 40960,
        "max_window_layers": 36,
        "model_type": "qwen3",
        "num_attention_heads": 4,
        "num_hidden_layers": 36,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 50,
    },
}


def _recipe(target_path: Path, recipe_args: dict) -> dict:
    """A raw recipe as train_eagle3 loads it (examples/speculative/eagle3/llama_eagle3_mvp.yaml's
    sections), ``recipe_args`` merged in."""
    return {
        "recipe": "TrainEagle3Recipe",
        "dist_env": {"backend": "nccl", "timeout_minutes": 30},
        "recipe_args": {
            "target_model_name_or_path": str(target_path),
            "train_data_path": "/path/to/train.jsonl",
            "seq_length": 1024,
            "micro_batch_size": 1,
            "num_epochs": 1,
            "ttt_steps": 4,
            "freeze_embeddings": True,
            **recipe_args,
        },
        "optimizer": {"lr": 1.0e-4, "betas": [0.9, 0.95], "weight_decay": 0.0},
        "checkpoint": {"enabled": True, "model_save_format": "safetensors", "save_consolidated": True},
    }


def build_draft(target_path: Path, recipe_args: dict, draft_edit: dict | None, seed: int):
    """The draft model as train_eagle3.setup builds it (0.7.0, lines 544-560 and 610-665)."""
    import torch
    from nemo_automodel.components.speculative.eagle.draft_llama import LlamaEagle3DraftModel
    from transformers import AutoConfig

    target_config = AutoConfig.from_pretrained(target_path)
    text_config = getattr(target_config, "text_config", None)
    draft_base_config = text_config if text_config is not None else target_config
    vocab = draft_base_config.vocab_size
    rng = np.random.default_rng(seed)
    n_draft = recipe_args.get("draft_vocab_size", vocab)
    selected_token_ids = torch.from_numpy(np.sort(rng.choice(vocab, n_draft, replace=False)))

    # train_eagle3.py 610-646
    draft_config = draft_base_config.to_dict()
    draft_config["draft_vocab_size"] = int(selected_token_ids.numel())
    draft_config["target_hidden_size"] = draft_base_config.hidden_size
    draft_config["architectures"] = ["LlamaEagle3DraftModel"]
    draft_config["tie_word_embeddings"] = False
    draft_config["attn_implementation"] = recipe_args.get("draft_attn_implementation", "eager")
    draft_config["fc_norm"] = bool(recipe_args.get("fc_norm", False))
    draft_config["norm_output"] = bool(recipe_args.get("norm_output", False))
    draft_config["parallel_drafting"] = bool(recipe_args.get("parallel_drafting", False))
    # What the recipe never sets but the draft model reads (target_hidden_size != hidden_size,
    # num_aux_hidden_states, norm_before_fc): a draft edited here is still built by Automodel.
    draft_config.update(draft_edit or {})
    # 658-659 (on the CPU the recipe's compute dtype is float32)
    draft_config_obj = type(draft_base_config).from_dict(draft_config)
    torch.manual_seed(seed)
    model = LlamaEagle3DraftModel(draft_config_obj).to(dtype=torch.float32)
    with torch.no_grad():  # distinct values everywhere (norms start at ones), so a swap shows
        for p in model.parameters():
            p.normal_()
    model.set_vocab_mapping(selected_token_ids)
    return model


def write_automodel_step(
    root: Path,
    target: str | dict = "llama3.1",
    recipe_args: dict | None = None,
    *,
    target_edit: dict | None = None,
    draft_edit: dict | None = None,
    snapshot: bool = True,
) -> tuple[Path, dict, dict]:
    """Train nothing, save a step: ``root/model/consolidated/{config.json, model.safetensors}``
    and ``root/config.yaml``. Returns (consolidated dir, its config.json, the state dict as numpy)."""
    from nemo_automodel.components.checkpoint.addons import _save_generated_hf_assets
    from nemo_automodel.components.checkpoint.checkpointing import save_config
    from safetensors.torch import save_file

    recipe_args = dict(recipe_args or {})
    target_path = root.with_name(root.name + "-target")
    target_path.mkdir(parents=True, exist_ok=True)
    base = TARGETS[target] if isinstance(target, str) else target
    (target_path / "config.json").write_text(json.dumps({**base, **(target_edit or {})}))
    model = build_draft(target_path, recipe_args, draft_edit, seed=len(root.name))

    consolidated = root / "model" / "consolidated"
    consolidated.mkdir(parents=True, exist_ok=True)
    _save_generated_hf_assets(model, None, str(consolidated), None, False)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(consolidated / "model.safetensors"), metadata={"format": "pt"})
    if snapshot:
        save_config(_recipe(target_path, recipe_args), str(root))
    config = json.loads((consolidated / "config.json").read_text())
    return consolidated, config, {k: v.numpy() for k, v in state.items()}
