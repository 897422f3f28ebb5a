"""Plan: rules compiled against a source index into the exact output tensors."""

from streamck.plan.compile import OutputTensor, Plan, compile_plan
from streamck.plan.eagle3 import eagle3_plan, eagle3_speculators_plan
from streamck.plan.eagle4 import eagle4_plan
from streamck.plan.megatron import megatron_plan
from streamck.plan.rules import Rule, Rules, load_rules
from streamck.plan.torchtitan import torchtitan_plan

BUILTIN_PLANS = {
    "eagle4": eagle4_plan,
    "eagle3": eagle3_plan,
    "eagle3-speculators": eagle3_speculators_plan,
    "torchtitan-llama3": torchtitan_plan,
    "megatron-gpt": megatron_plan,
}
# Built-in plans that take --verifier (refused for the others).
VERIFIER_PLANS = frozenset({"eagle3-speculators"})
# Built-in plans that take --aux-layer-ids (refused for the others).
AUX_LAYER_PLANS = frozenset({"eagle3", "eagle3-speculators"})
# Built-in plans that take --hf-config: a trainer's checkpoint to a Hugging Face model.
HF_CONFIG_PLANS = frozenset({"torchtitan-llama3", "megatron-gpt"})

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
]
