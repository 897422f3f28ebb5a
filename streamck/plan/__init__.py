"""Plan: rules compiled against a source index into the exact output tensors."""

from streamck.plan.compile import OutputTensor, Plan, compile_plan
from streamck.plan.eagle4 import eagle4_plan
from streamck.plan.rules import Rule, Rules, load_rules

BUILTIN_PLANS = {"eagle4": eagle4_plan}

__all__ = [
    "BUILTIN_PLANS",
    "OutputTensor",
    "Plan",
    "Rule",
    "Rules",
    "compile_plan",
    "eagle4_plan",
    "load_rules",
]
