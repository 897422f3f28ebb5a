"""Plan: rules compiled against a source index into the exact output tensors."""

from streamck.plan.compile import OutputTensor, Plan, compile_plan
from streamck.plan.rules import Rule, Rules, load_rules

__all__ = ["OutputTensor", "Plan", "Rule", "Rules", "compile_plan", "load_rules"]
