"""Plan: rules compiled against a source index into the exact output tensors."""

from streamck.plan.compile import OutputTensor, Plan, compile_plan
from streamck.plan.eagle3 import eagle3_plan, eagle3_speculators_plan
from streamck.plan.eagle4 import eagle4_plan
from streamck.plan.rules import Rule, Rules, load_rules

BUILTIN_PLANS = {"eagle4": eagle4_plan, "eagle3": eagle3_plan, "eagle3-speculators": eagle3_speculators_plan}
# Built-in plans that take --verifier (refused for the others).
VERIFIER_PLANS = frozenset({"eagle3-speculators"})
# Built-in plans that take --aux-layer-ids (refused for the others).
AUX_LAYER_PLANS = frozenset({"eagle3", "eagle3-speculators"})

__all__ = [
    "AUX_LAYER_PLANS",
    "BUILTIN_PLANS",
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
]
