"""Plan: rules compiled against a source index into the exact output tensors.

The built-in plans' modules are imported when a plan is asked for (``BUILTIN_PLANS[name]``
or ``streamck.plan.megatron_plan``): ``import streamck.api`` should not pay for the
trainers' readers (distcp, the ZeRO files) that only ``--plan megatron-gpt`` needs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from importlib import import_module

from streamck._lazy import lazy_getattr
from streamck.plan.compile import OutputTensor, Plan, compile_plan
from streamck.plan.rules import Rule, Rules, load_rules

# Built-in plan name -> (its module, its function).
PLAN_FUNCTIONS = {
    "eagle4": ("streamck.plan.eagle4.plan", "eagle4_plan"),
    "eagle3": ("streamck.plan.eagle3.plan", "eagle3_plan"),
    "eagle3-speculators": ("streamck.plan.eagle3.plan", "eagle3_speculators_plan"),
    "torchtitan": ("streamck.plan.torchtitan.plan", "torchtitan_plan"),
    "torchtitan-llama3": ("streamck.plan.torchtitan.plan", "torchtitan_plan"),  # its first name, kept
    "megatron-gpt": ("streamck.plan.megatron.plan", "megatron_plan"),
    "olmo2": ("streamck.plan.olmo2.plan", "olmo2_plan"),
}
# The plan functions as attributes of this package, imported on first use.
_LAZY = {function: module for module, function in PLAN_FUNCTIONS.values()}


class _BuiltinPlans(Mapping[str, Callable[..., Plan]]):
    """The built-in plans by name; a plan's module is imported when the plan is looked up."""

    def __getitem__(self, name: str) -> Callable[..., Plan]:
        module, function = PLAN_FUNCTIONS[name]
        return getattr(import_module(module), function)

    def __iter__(self) -> Iterator[str]:
        return iter(PLAN_FUNCTIONS)

    def __len__(self) -> int:
        return len(PLAN_FUNCTIONS)


BUILTIN_PLANS = _BuiltinPlans()
# Built-in plans that take --verifier (refused for the others).
VERIFIER_PLANS = frozenset({"eagle3-speculators"})
# Built-in plans that take --aux-layer-ids (refused for the others).
AUX_LAYER_PLANS = frozenset({"eagle3", "eagle3-speculators"})
# Built-in plans that take --hf-config: a trainer's checkpoint to a Hugging Face model.
HF_CONFIG_PLANS = frozenset({"torchtitan", "torchtitan-llama3", "megatron-gpt", "olmo2"})


__getattr__ = lazy_getattr(__name__, globals(), _LAZY)


__all__ = [
    "AUX_LAYER_PLANS",
    "BUILTIN_PLANS",
    "HF_CONFIG_PLANS",
    "VERIFIER_PLANS",
    "OutputTensor",
    "Plan",
    "Rule",
    "Rules",
    "compile_plan",
    "eagle3_plan",
    "eagle3_speculators_plan",
    "eagle4_plan",
    "load_rules",
    "megatron_plan",
    "olmo2_plan",
    "torchtitan_plan",
]
