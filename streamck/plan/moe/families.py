"""How each Hugging Face MoE family names its experts: at run time (what a trainer saves from
``model.state_dict()``) and on disk (what ``save_pretrained`` writes), as data.

transformers 5 keeps a layer's routed experts fused while it runs: ``<block>.experts.gate_up_proj``
[E, 2I, H] (expert e's gate rows first, then its up rows) and ``<block>.experts.down_proj``
[E, H, I]. ``save_pretrained`` reverts the family's entry of ``transformers/conversion_mapping.py``
(a ``MergeModulelist`` + ``Concatenate(dim=1)`` for gate/up, ``MergeModulelist`` for down, and
renames), so per-expert families write ``<disk block>.experts.e.<gate>.weight`` =
``gate_up_proj[e, :I]``, ``….<up>.weight`` = ``gate_up_proj[e, I:]`` and ``….<down>.weight`` =
``down_proj[e]``. Families whose checkpoints hold fused tensors already (gpt-oss, Llama 4: gate/up
transposed or interleaved) write them as they run. Each row was checked against
transformers 5.19's own ``save_pretrained`` (tests/test_moe_families.py).
"""

from __future__ import annotations

from dataclasses import dataclass

# The config keys that give the routed expert count, by family (the first one present wins).
COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
# The runtime names of a block's fused experts (after ``<block>.experts.``).
GATE_UP, DOWN = "gate_up_proj", "down_proj"


@dataclass(frozen=True)
class Family:
    """One family's expert layout.

    ``block`` is the module holding ``experts`` at run time (``mlp``, ``feed_forward``,
    ``block_sparse_moe``) and ``disk_block`` its name in ``save_pretrained``'s files; every
    tensor under an MoE block takes ``disk_block`` there. ``experts`` are the per-expert disk
    names of gate, up and down (``gate_proj``/``up_proj``/``down_proj``, Mixtral's
    ``w1``/``w3``/``w2``), or None where the file keeps them fused. ``renames`` map a suffix
    under the runtime block to its disk suffix (a router that the file names otherwise).
    ``router`` is the runtime suffix of the router's weight, [E, H].
    """

    block: str
    disk_block: str
    experts: tuple[str, str, str] | None
    router: str
    renames: tuple[tuple[str, str], ...] = ()

    @property
    def per_expert(self) -> bool:
        return self.experts is not None

    def disk_suffix(self, suffix: str) -> str:
        """The disk name of a tensor ``<block>.<suffix>`` of an MoE block, after ``<disk_block>.``."""
        return dict(self.renames).get(suffix, suffix)

    def runtime_suffix(self, suffix: str) -> str:
        """The inverse of disk_suffix."""
        return {disk: run for run, disk in self.renames}.get(suffix, suffix)


_QWEN = Family("mlp", "mlp", ("gate_proj", "up_proj", "down_proj"), "gate.weight")
_MIXTRAL = Family("mlp", "block_sparse_moe", ("w1", "w3", "w2"), "gate.weight")

# model_type -> layout (transformers' _MODEL_TO_CONVERSION_PATTERN maps many types onto these).
FAMILIES: dict[str, Family] = {
    "qwen2_moe": _QWEN,
    "qwen3_moe": _QWEN,
    "qwen3_next": _QWEN,
    "deepseek_v2": _QWEN,
    "deepseek_v3": _QWEN,
    "glm4_moe": _QWEN,
    "olmoe": _QWEN,
    "hunyuan_v1_moe": Family("mlp", "mlp", _QWEN.experts, "gate.wg.weight"),
    "ernie4_5_moe": Family(
        "mlp",
        "mlp",
        _QWEN.experts,
        "gate.weight",
        (("gate.moe_statics.e_score_correction_bias", "moe_statics.e_score_correction_bias"),),
    ),
    "jamba": Family("feed_forward", "feed_forward", _QWEN.experts, "router.weight"),
    "mixtral": _MIXTRAL,
    "minimax": _MIXTRAL,
    "phimoe": Family("mlp", "block_sparse_moe", _MIXTRAL.experts, "router.weight", (("router.weight", "gate.weight"),)),
    # Fused on disk as at run time (gpt-oss: gate/up interleaved, [E, H, 2I]; Llama 4: [E, H, 2I]).
    "gpt_oss": Family("mlp", "mlp", None, "router.weight"),
    "llama4_text": Family("feed_forward", "feed_forward", None, "router.weight"),
}


def family_of(model_type: str | None) -> Family | None:
    """The layout for ``model_type`` (config.json's), or None when there is no known one."""
    return FAMILIES.get(model_type) if isinstance(model_type, str) else None


def expert_count(config: dict) -> int | None:
    """The routed expert count a config states (COUNT_KEYS), or None."""
    for key in COUNT_KEYS:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None
