"""A DeepseekV3 config checked against the Megatron run's ``args``: sizes, which layers are dense,
routing and RoPE, each where transformers would compute another model than Megatron did.

Megatron's routing (megatron-core 0.19.2 ``moe/moe_utils.py`` ``topk_routing_with_score_function``,
``group_limited_topk``): sigmoid scores, ``expert_bias`` added for the choice only, groups ranked by
the sum of their top ``topk // group_topk`` scores, the chosen scores renormalised when top-k > 1,
times ``moe_router_topk_scaling_factor``. transformers' ``DeepseekV3TopkRouter`` does the same with
``n_group`` / ``topk_group``, but ranks groups by their top 2 and renormalises by ``norm_topk_prob``.
RoPE: ``MultiLatentAttention`` builds plain RoPE (``rope_type: rope``) or YaRN (Megatron's default
for MLA) from ``rotary_base``, ``rotary_scaling_factor``, ``original_max_position_embeddings``,
``beta_fast``/``beta_slow``, ``mscale``/``mscale_all_dim`` (MLATransformerConfig's defaults where the
args lack one) and scales the softmax by ``mscale_all_dim``'s mscale squared, as transformers' does.
"""

from __future__ import annotations

from pathlib import Path

from streamck.errors import PlanError
from streamck.plan import hf_export

# DeepseekV3 config key -> the Megatron arg of that size; compared where the args hold it.
SIZES = {
    "num_hidden_layers": "num_layers",
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_attention_heads",
    "intermediate_size": "ffn_hidden_size",
    "kv_lora_rank": "kv_lora_rank",
    "qk_nope_head_dim": "qk_head_dim",
    "qk_rope_head_dim": "qk_pos_emb_head_dim",
    "v_head_dim": "v_head_dim",
    "n_routed_experts": "num_experts",
    "moe_intermediate_size": "moe_ffn_hidden_size",
}
# YaRN: HF rope_parameters key -> (Megatron arg, MLATransformerConfig's default, HF's default).
YARN = {
    "factor": ("rotary_scaling_factor", None, None),
    "original_max_position_embeddings": ("original_max_position_embeddings", 4096, None),
    "beta_fast": ("beta_fast", 32.0, 32.0),
    "beta_slow": ("beta_slow", 1.0, 1.0),
    "mscale": ("mscale", 1.0, 1.0),
    "mscale_all_dim": ("mscale_all_dim", 0.0, 0.0),
}
ROPE_TYPES = {"rope": "default", "yarn": "yarn"}


def _int(config: dict, key: str, where: Path, zero: bool = False) -> int:
    value = config.get(key)
    if type(value) is not int or value < (0 if zero else 1):
        raise PlanError(f"{key} must be a {'non-negative' if zero else 'positive'} integer, not {value!r}", where)
    return value


def config_sizes(config: dict, where: Path) -> dict[str, int]:
    """The shape symbols (mla_layout.SYMBOLS) and K (dense layers) of a DeepseekV3 config."""
    base = hf_export.sizes(config, where)
    got = {k: _int(config, k, where) for k in SIZES if k not in hf_export.SYMBOLS.values()}
    shared = _int(config, "n_shared_experts", where)
    qa = config.get("q_lora_rank")
    if qa is not None and (type(qa) is not int or qa <= 0):
        raise PlanError(f"q_lora_rank must be null or a positive integer, not {qa!r}", where)
    if base["nkv"] != base["nh"]:  # else transformers repeats the latent heads it already has
        raise PlanError("num_key_value_heads must equal num_attention_heads: MLA has one key per head", where)
    if config.get("attention_bias") is True:
        raise PlanError("attention_bias: true, but Megatron's MLA has no biases (add_bias_linear off)", where)
    if config.get("rope_interleave", True) is not True:
        raise PlanError("rope_interleave must be true: Megatron's MLA rotates interleaved RoPE pairs", where)
    nope, rope, dv = got["qk_nope_head_dim"], got["qk_rope_head_dim"], got["v_head_dim"]
    im = got["moe_intermediate_size"]
    return {
        **{s: base[s] for s in ("L", "H", "nh", "I", "V")},
        "qa": qa or 0, "kv": got["kv_lora_rank"], "dv": dv, "E": got["n_routed_experts"], "Im": im,
        "S": im * shared, "dq": nope + rope, "kvr": got["kv_lora_rank"] + rope, "dkv": nope + dv,
        "K": _int(config, "first_k_dense_replace", where, zero=True), "rope": rope,
    }  # fmt: skip


def check_args(args: dict, config: dict, sizes: dict[str, int], config_path: Path) -> None:
    """Each size, the dense layers, routing and RoPE of ``args`` equal to the config's."""
    for key, arg in SIZES.items():
        if key == "intermediate_size" and not sizes["K"]:
            continue  # no dense layer: the config's dense MLP size is never used
        if args.get(arg) is not None and args[arg] != config.get(key):
            raise PlanError(f"{key} is {config.get(key)!r}, the checkpoint's args.{arg} {args[arg]!r}", config_path)
    if "q_lora_rank" in args and args["q_lora_rank"] != config.get("q_lora_rank"):
        raise PlanError(f"q_lora_rank is {config.get('q_lora_rank')!r}, the checkpoint's args.q_lora_rank "
                        f"{args['q_lora_rank']!r}", config_path)  # fmt: skip
    shared = args.get("moe_shared_expert_intermediate_size")
    if shared != sizes["S"]:
        raise PlanError(f"moe_intermediate_size * n_shared_experts is {sizes['S']}, the checkpoint's "
                        f"args.moe_shared_expert_intermediate_size {shared!r}", config_path)  # fmt: skip
    pattern = dense_pattern(args, sizes["L"])
    want = [i < sizes["K"] for i in range(sizes["L"])]
    if pattern is not None and pattern != want:
        dense = [i for i, d in enumerate(pattern) if d]
        raise PlanError(f"first_k_dense_replace is {sizes['K']}, the checkpoint's args.moe_layer_freq makes "
                        f"layers {dense} dense", config_path)  # fmt: skip
    check_routing(args, config, config_path)
    check_rope(args, config, sizes, config_path)


def dense_pattern(args: dict, layers: int) -> list[bool] | None:
    """Which layers ``args.moe_layer_freq`` makes dense (megatron-core's ``get_gpt_decoder_layer_specs``:
    an int N puts experts in every Nth layer from 0, a list says 1 for experts), None when absent."""
    freq = args.get("moe_layer_freq")
    if isinstance(freq, int) and freq > 0:
        return [i % freq != 0 for i in range(layers)]
    if isinstance(freq, (list, tuple)) and len(freq) == layers:
        return [f == 0 for f in freq]
    return None


def check_routing(args: dict, config: dict, where: Path) -> None:
    """transformers' DeepseekV3 router picks and weighs the experts Megatron's did."""
    score = args.get("moe_router_score_function", "softmax")
    if score != "sigmoid":
        raise PlanError(f"the checkpoint's args.moe_router_score_function is {score!r}: DeepseekV3 routes by "
                        "sigmoid scores", where)  # fmt: skip
    topk = args.get("moe_router_topk")
    if type(topk) is not int or topk != config.get("num_experts_per_tok"):
        raise PlanError(f"num_experts_per_tok is {config.get('num_experts_per_tok')!r}, the checkpoint's args "
                        f"route to {topk!r}", where)  # fmt: skip
    if bool(config.get("norm_topk_prob")) != (topk > 1):
        raise PlanError(f"norm_topk_prob must be {str(topk > 1).lower()}: Megatron renormalises sigmoid top-k "
                        "weights exactly when it routes to more than one expert", where)  # fmt: skip
    scale, says = args.get("moe_router_topk_scaling_factor") or 1.0, config.get("routed_scaling_factor", 1.0)
    if scale != says:
        raise PlanError(f"routed_scaling_factor is {says!r}, the checkpoint's args.moe_router_topk_scaling_factor "
                        f"{scale!r}", where)  # fmt: skip
    groups, chosen = args.get("moe_router_num_groups"), args.get("moe_router_group_topk")
    n_group, topk_group = config.get("n_group", 1), config.get("topk_group", 1)
    if not chosen:  # Megatron ranks no groups: every group of the config must be chosen
        if topk_group != n_group:
            raise PlanError(f"n_group {n_group} with topk_group {topk_group} limits the experts a token may "
                            "take; the checkpoint's args route without groups (moe_router_group_topk unset)",
                            where)  # fmt: skip
    elif (groups, chosen) != (n_group, topk_group):
        raise PlanError(f"n_group/topk_group are {n_group}/{topk_group}, the checkpoint's args "
                        f"moe_router_num_groups/moe_router_group_topk {groups}/{chosen}", where)  # fmt: skip
    elif chosen != groups and topk // chosen != 2:
        raise PlanError(f"Megatron ranks groups by their top {topk // chosen} scores (moe_router_topk // "
                        "moe_router_group_topk), transformers' DeepseekV3 by their top 2", where)  # fmt: skip


def check_rope(args: dict, config: dict, sizes: dict[str, int], where: Path) -> None:
    """transformers builds the RoPE and softmax scale Megatron's MultiLatentAttention used."""
    if args.get("rotary_interleaved"):
        raise PlanError("the checkpoint's args.rotary_interleaved: MLA would rotate its pairs twice", where)
    if args.get("rotary_percent", 1.0) != 1.0:
        raise PlanError(f"the checkpoint's args.rotary_percent is {args['rotary_percent']}: DeepseekV3 rotates "
                        "all of qk_rope_head_dim", where)  # fmt: skip
    params = config.get("rope_parameters") or {}
    kind = args.get("rope_type") or "yarn"  # Megatron-LM's default for multi-latent attention
    says = params.get("rope_type", "default")
    if ROPE_TYPES.get(kind) != says:
        raise PlanError(f"rope_parameters.rope_type is {says!r}, the checkpoint's args.rope_type {kind!r}", where)
    theta = params.get("rope_theta", config.get("rope_theta"))
    if theta != args.get("rotary_base", 10000):
        raise PlanError(f"rope_theta is {theta!r}, the checkpoint's args.rotary_base "
                        f"{args.get('rotary_base', 10000)!r}", where)  # fmt: skip
    factor, all_dim = args.get("rotary_scaling_factor", 1.0), args.get("mscale_all_dim", 0.0)
    if kind == "rope":
        if all_dim and factor > 1:
            raise PlanError("the checkpoint's args scale MLA's softmax by mscale_all_dim without YaRN: "
                            "transformers' DeepseekV3 does so only with rope_type yarn", where)  # fmt: skip
        return
    for key, (arg, default, hf_default) in YARN.items():
        mine, theirs = args.get(arg, default), params.get(key, hf_default)
        if mine is None or theirs is None or float(mine) != float(theirs):
            raise PlanError(f"rope_parameters.{key} is {theirs!r}, the checkpoint's args.{arg} {mine!r}", where)
    if params.get("attention_factor") is not None or params.get("truncate") is False:
        raise PlanError("rope_parameters sets attention_factor or truncate: false; Megatron's YaRN derives "
                        "one and truncates the other", where)  # fmt: skip
    if args.get("mscale", 1.0) != 1.0 and not all_dim:
        raise PlanError("the checkpoint's args.mscale without mscale_all_dim: transformers ignores mscale then",
                        where)  # fmt: skip
