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
from streamck.registry import BUILTINS, Builtin

# Built-in plan name -> (its module, its function).
PLAN_FUNCTIONS = {b.name: (b.module, b.function) for b in BUILTINS}
# The plans that take each of SourceSpec's plan options (refused for the others).
VERIFIER_PLANS = frozenset(b.name for b in BUILTINS if "verifier" in b.options)
AUX_LAYER_PLANS = frozenset(b.name for b in BUILTINS if "aux_layer_ids" in b.options)
HF_CONFIG_PLANS = frozenset(b.name for b in BUILTINS if "hf_config" in b.options)

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


__getattr__ = lazy_getattr(__name__, globals(), _LAZY)


__all__ = [
    "AUX_LAYER_PLANS",
    "BUILTINS",
    "BUILTIN_PLANS",
    "HF_CONFIG_PLANS",
    "VERIFIER_PLANS",
    "Builtin",
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
