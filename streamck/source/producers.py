"""Which trainer wrote a checkpoint, when its tensor names say so, and the built-in plan that
turns it into a model a loader reads right: for the hint ``ls`` and a rewrite without
``--plan`` give. A rewrite that only renames such a checkpoint writes a model that loads and
is silently wrong (q and k rows still in the trainer's order, layers still stacked), so the
hint names the plan, never just a rule that drops the optimizer state.

Detection is by tensor names alone (the folder's name says less: ``step-N`` and ``iter_N``
are also what people call their own exports); the plans check everything else.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping, Set

# (what wrote it, what to do instead of renaming it, tensor-name globs that each match some
# tensor). First match wins: EAGLE-4 drafts hold EAGLE-3's marks too.
PRODUCERS = (
    (
        "a torchtitan MoE step (Qwen3-MoE)",
        "--plan torchtitan writes a Hugging Face model (renamed alone, experts stay grouped per layer)",
        ("tok_embeddings.weight", "layers.*.moe.routed_experts.inner_experts.w1_EFD"),
    ),
    (
        "a torchtitan step (Llama 3 / Qwen3)",
        "--plan torchtitan writes a Hugging Face model (renamed alone, q and k keep torchtitan's row order)",
        ("tok_embeddings.weight", "layers.*.attention.*wq.weight"),
    ),
    (
        "a Megatron torch_dist checkpoint (GPTModel, multi-latent attention: DeepSeek-V3)",
        "--plan megatron-gpt with --hf-config naming model_type deepseek_v3 writes a Hugging Face model "
        "(renamed alone, layers and experts stay stacked)",
        ("embedding.word_embeddings.weight", "decoder.layers.*self_attention.linear_kv_down_proj.weight"),
    ),
    (
        "a Megatron torch_dist checkpoint (GPTModel)",
        "--plan megatron-gpt writes a Hugging Face model (renamed alone, layers stay stacked, q/k/v interleaved)",
        ("embedding.word_embeddings.weight", "decoder.layers.self_attention.linear_qkv.weight"),
    ),
    (
        "a NeMo Automodel EAGLE-4 draft",
        "--plan eagle4 writes the serving layout and config engines load",
        ("model.fc.weight", "efficient_lm_head.weight"),
    ),
    (
        "a NeMo Automodel EAGLE-3 draft",
        "--plan eagle3 (vLLM, SGLang) or --plan eagle3-speculators writes the serving layout and config engines load",
        ("model.fc.weight", "model.layers.0.hidden_norm.weight"),
    ),
)


def plan_hint(names: Iterable[str]) -> str | None:
    """The line naming the plan for a checkpoint with tensors ``names``, or None when no
    producer with a plan is recognised."""
    names = names if isinstance(names, Mapping | Set) else set(names)
    for who, advice, marks in PRODUCERS:
        if all(_found(names, mark) for mark in sorted(marks, key=_is_glob)):  # plain names first
            return f"this looks like {who}: {advice}"
    return None


def _is_glob(mark: str) -> bool:
    return any(c in mark for c in "*?[")


def _found(names: Mapping[str, object] | Set[str], mark: str) -> bool:
    """Whether some name matches ``mark``: one lookup for a plain name, a scan only for a glob.
    Every producer has a plain mark, so a checkpoint of none of them is never scanned (six
    fnmatch passes over every name were 0.12 s of a 92k-tensor rewrite, #44)."""
    if not _is_glob(mark):
        return mark in names
    match = re.compile(fnmatch.translate(mark)).match
    return any(match(n) for n in names)
