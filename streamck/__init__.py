"""streamck: rewrite safetensors checkpoints without holding them in memory.

One call per command::

    streamck.rewrite("llama-70b", "out", rules=[{"strip_prefix": "model."}], dtype="bf16")
    streamck.diff("golden.keys.json", "out")            # also ls(), hash()

or the data flow step by step, source → plan → writer::

    ckpt = open_checkpoint("llama-70b")                 # headers only
    plan = compile_plan(ckpt, Rules((Rule("strip_prefix", "model."),)))
    write_plan(plan, "out", max_shard_size=5 * 10**9)  # bounded memory, atomic
"""

from streamck.api import build_plan, diff, export_eagle4_draft, hash, ls, rewrite
from streamck.errors import CheckpointError, DeviceError, OutputError, PlanError, StreamckError, UsageError
from streamck.manifest import checkpoint_manifest, plan_manifest
from streamck.plan import OutputTensor, Plan, Rule, Rules, compile_plan, eagle4_plan, load_rules
from streamck.source import Checkpoint, TensorRef, open_checkpoint
from streamck.writer import WriteResult, write_plan

__version__ = "0.1.0"

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "DeviceError",
    "OutputError",
    "OutputTensor",
    "Plan",
    "PlanError",
    "Rule",
    "Rules",
    "StreamckError",
    "TensorRef",
    "UsageError",
    "WriteResult",
    "build_plan",
    "checkpoint_manifest",
    "compile_plan",
    "diff",
    "eagle4_plan",
    "export_eagle4_draft",
    "hash",
    "load_rules",
    "ls",
    "open_checkpoint",
    "plan_manifest",
    "rewrite",
    "write_plan",
]
