"""streamck: rewrite safetensors checkpoints without holding them in memory.

Data flows source → plan → writer::

    ckpt = open_checkpoint("llama-70b")                 # headers only
    plan = compile_plan(ckpt, Rules((Rule("strip_prefix", "model."),)))
    rewrite(plan, "out", max_shard_size=5 * 10**9)     # bounded memory, atomic
"""

from streamck.errors import CheckpointError, OutputError, PlanError, StreamckError
from streamck.manifest import checkpoint_manifest, plan_manifest
from streamck.plan import OutputTensor, Plan, Rule, Rules, compile_plan, eagle4_plan, export_eagle4_draft, load_rules
from streamck.source import Checkpoint, TensorRef, open_checkpoint
from streamck.writer import WriteResult, rewrite

__version__ = "0.1.0"

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "OutputError",
    "OutputTensor",
    "Plan",
    "PlanError",
    "Rule",
    "Rules",
    "StreamckError",
    "TensorRef",
    "WriteResult",
    "checkpoint_manifest",
    "compile_plan",
    "eagle4_plan",
    "export_eagle4_draft",
    "load_rules",
    "open_checkpoint",
    "plan_manifest",
    "rewrite",
]
