"""NeMo Automodel EAGLE-3 draft steps (built by Automodel's own code: automodel_eagle3.py),
and what the serving engines do with a served config, written out here as data with the
engine versions and files they were read from, independently of streamck's tables
(``streamck/plan/eagle3/layout.py``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from automodel_eagle3 import write_automodel_step
from eagle4_drafts import serving_name  # noqa: F401  the same rename for both plans: model. dropped
from helpers import write_step


def make_draft(
    root: Path,
    recipe: dict | None = None,
    *,
    target: str = "llama3.1",
    target_edit: dict | None = None,
    draft_edit: dict | None = None,
    json_edit: dict | None = None,
    tensors_edit=None,
    consolidated: bool = True,
    shards: int = 0,
    snapshot: bool = True,
) -> tuple[Path, dict, dict]:
    """An Automodel step under ``root`` for ``target`` trained with ``recipe`` (recipe_args),
    with ``config.yaml`` beside it (unless not ``snapshot``). ``target_edit`` changes the
    target's config.json, ``draft_edit`` the draft config before Automodel builds the model;
    ``json_edit`` (None deletes) and ``tensors_edit`` damage what was saved. Without
    ``consolidated`` the files sit in the step itself; ``shards`` splits them.
    Returns (the step, its config.json, its tensors)."""
    _, config, tensors = write_automodel_step(
        root, target, recipe, target_edit=target_edit, draft_edit=draft_edit, snapshot=snapshot
    )
    if not (json_edit or tensors_edit or shards or not consolidated):
        return root, config, tensors
    edit = json_edit or {}
    config = {k: v for k, v in {**config, **edit}.items() if v is not None or k not in edit}
    if tensors_edit:
        tensors_edit(tensors)
    shutil.rmtree(root / "model")
    return write_step(root, config, tensors, consolidated=consolidated, shards=shards), config, tensors


# ---- how the engines read the aux layer ids -------------------------------------------------
# name: (version, config keys tried in order (the first non-empty wins), what the engine adds
# to an id before capturing, the last capture point, where it was read). A capture at point c
# is the residual stream entering target layer c, i.e. the output of layer c - 1; c = n is
# the output of the last layer.
AUX_READERS = {
    "vllm": (
        "vLLM 0.33.0",
        (("eagle_aux_hidden_state_layer_ids",), ("eagle_config", "eagle_aux_hidden_state_layer_ids")),
        0,
        "n",  # records after layer idx under idx + 1, for idx up to n - 1
        "v1/worker/gpu_model_runner.py _get_eagle3_aux_layers_from_config; model_executor/models/llama.py "
        "and qwen2.py LlamaModel/Qwen2Model.forward (_maybe_add_hidden_state(aux, idx + 1, ...))",
    ),
    # vLLM's second model runner (VLLM_USE_V2_MODEL_RUNNER) falls back to eagle_config's
    # layer_ids, not eagle_aux_hidden_state_layer_ids: only the top-level key reaches it.
    "vllm_v2": (
        "vLLM 0.33.0",
        (("eagle_aux_hidden_state_layer_ids",), ("eagle_config", "layer_ids")),
        0,
        "n",
        "v1/worker/gpu/spec_decode/eagle/eagle3_utils.py get_eagle3_aux_layers_from_config",
    ),
    "sglang": (
        "SGLang 0.5.23",
        (("eagle_config", "eagle_aux_hidden_state_layer_ids"),),
        1,
        "n-1",  # captures at the input of layer i, for i in range(n)
        "srt/model_executor/model_runner_components/spec_aux_hidden_state.py _resolve_eagle_aux_hidden_state; "
        "srt/models/llama.py and qwen3.py set_eagle3_layers_to_capture ([val + 1 ...]), LlamaModel.forward",
    ),
    # vLLM serving a speculators checkpoint: the adapter copies only the top-level ids into the
    # config vLLM builds from transformer_layer_config; the capture is vLLM's.
    "vllm_speculators": (
        "vLLM 0.33.0",
        (("eagle_aux_hidden_state_layer_ids",),),
        0,
        "n",
        "transformers_utils/configs/speculators/algos.py update_eagle3, base.py "
        "extract_transformers_pre_trained_config",
    ),
}


def captured_layers(served: dict, engine: str, n: int) -> list[int | None]:
    """The target layer whose output each aux state the engine captures is (None: captured
    nowhere, or the embeddings), for a target of ``n`` layers."""
    _, keys, add, last, _ = AUX_READERS[engine]
    ids = None
    for path in keys:
        node = served
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if node:
            ids = node
            break
    assert ids, f"{engine} finds no aux layer ids"
    top = n if last == "n" else n - 1
    return [c - 1 if 1 <= c <= top else None for c in (j + add for j in ids)]


def speculators_as_vllm(body: dict) -> dict:
    """The config vLLM 0.33 builds its draft from for a speculators checkpoint:
    transformer_layer_config updated by the eagle3 adapter (transformers_utils/configs/
    speculators/base.py extract_transformers_pre_trained_config, algos.py update_eagle3)."""
    pre = dict(body["transformer_layer_config"])
    pre["draft_vocab_size"] = body.get("draft_vocab_size")
    if body.get("target_hidden_size") is not None:
        pre["target_hidden_size"] = body["target_hidden_size"]
    pre["norm_before_residual"] = body.get("norm_before_residual", True)
    for key in ("norm_before_fc", "fc_norm", "norm_output"):
        pre[key] = body.get(key, False)
    pre["architectures"] = [{"qwen3": "Eagle3Qwen3ForCausalLM", "llama": "Eagle3LlamaForCausalLM"}[pre["model_type"]]]
    if body.get("eagle_aux_hidden_state_layer_ids"):
        pre["eagle_aux_hidden_state_layer_ids"] = body["eagle_aux_hidden_state_layer_ids"]
    return pre


# ---- what the engines build from a served config.json, and how their loaders map names ----
# vLLM 0.33 model_executor/models/llama_eagle3.py (LlamaModel.__init__, Eagle3LlamaForCausalLM)
# and SGLang 0.5.23 srt/models/llama_eagle3.py (LlamaModel.__init__, LlamaForCausalLMEagle3).

STACKED = ((".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj"))
STACKED += ((".gate_proj", ".gate_up_proj"), (".up_proj", ".gate_up_proj"))


def engine_aux_count(config: dict) -> int:
    """How many aux states both engines size fc for: num_aux_hidden_states, else the length of
    eagle_config's ids, else 3."""
    if config.get("num_aux_hidden_states") is not None:
        return config["num_aux_hidden_states"]
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return len(ids) if ids else 3


def engine_params(config: dict, engine: str) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of the module each engine builds from the served config."""
    H, I = config["hidden_size"], config["intermediate_size"]  # noqa: E741
    nh, nkv, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    V, Vd, T = config["vocab_size"], config["draft_vocab_size"], config["target_hidden_size"]
    aux = engine_aux_count(config)
    eagle = config.get("eagle_config") or {}
    norm_before_fc = eagle.get("norm_before_fc", config.get("norm_before_fc", False))
    assert config["num_hidden_layers"] == 1
    layer = "model.layers.0."
    p = {
        "model.embed_tokens.weight": (V, H),
        "model.fc.weight": (H, aux * T),
        layer + "self_attn.qkv_proj.weight": ((nh + 2 * nkv) * d, 2 * H),
        layer + "self_attn.o_proj.weight": (H, nh * d),
        layer + "mlp.gate_up_proj.weight": (2 * I, H),
        layer + "mlp.down_proj.weight": (H, I),
        layer + "input_layernorm.weight": (H,),
        layer + "post_attention_layernorm.weight": (H,),
        layer + "hidden_norm.weight": (H,),
        "model.norm.weight": (H,),
    }
    if norm_before_fc:
        p["model.input_norm.weight"] = (aux * T,)
    if config.get("fc_norm"):
        p |= {f"model.fc_norm.{i}.weight": (T,) for i in range(aux)}
    if config["tie_word_embeddings"] is False:
        p["lm_head.weight"] = (Vd, H)
    if engine == "vllm" and Vd < V:
        # Built at zeros whatever Vd is; zeros are the identity map when Vd = V, a wrong one otherwise.
        p["draft_id_to_target_id"] = (Vd,)
    return p


def engine_load(name: str, engine: str) -> str | None:
    """The parameter a checkpoint key lands in (None: consumed outside the parameters)."""
    if engine == "vllm":
        if name == "t2d":
            return None
        if name == "d2t":
            return "draft_id_to_target_id"
        name = name if name.startswith("lm_head") else "model." + name
    else:
        if name in ("d2t", "t2d"):  # d2t becomes hot_token_id; t2d is skipped
            return None
        name = name if name.startswith("lm_head") else "model." + name
    for shard, fused in STACKED:
        if shard in name:
            return name.replace(shard, fused)
    return name


def engine_shape(keys: dict[str, tuple[int, ...]], param: str) -> tuple[int, ...]:
    """The shape a fused parameter gets from the checkpoint shards that load into it."""
    parts = [s for k, s in keys.items() if k not in ("d2t", "t2d") and engine_load(k, "sglang") == param]
    if param == "draft_id_to_target_id":
        parts = [keys["d2t"]]
    return (sum(s[0] for s in parts), *parts[0][1:])
