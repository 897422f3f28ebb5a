"""streamck: rewrite safetensors checkpoints without holding them in memory.

One call per command::

    streamck.rewrite("llama-70b", "out", rules=[{"strip_prefix": "model."}], dtype="bf16")
    streamck.diff("golden.keys.json", "out")            # also ls(), hash()

or the data flow step by step, source → plan → writer::

    ckpt = open_checkpoint("llama-70b")                 # headers only
    plan = compile_plan(ckpt, Rules((Rule("strip_prefix", "model."),)))
    write_plan(plan, "out", max_shard_size=5 * 10**9)  # bounded memory, atomic
"""

from importlib import import_module as _import_module
from typing import Any as _Any

# Public names and the module each lives in. They are imported on first use, so that
# ``streamck ls`` (or ``import streamck.source``) does not pay for the writer and the
# plans: a key-set check in CI should start in milliseconds.
_EXPORTS = {
    "build_plan": "streamck.api",
    "diff": "streamck.api",
    "export_eagle4_draft": "streamck.api",
    "hash": "streamck.api",
    "ls": "streamck.api",
    "rewrite": "streamck.api",
    "CheckpointError": "streamck.errors",
    "DeviceError": "streamck.errors",
    "OutputError": "streamck.errors",
    "PlanError": "streamck.errors",
    "StreamckError": "streamck.errors",
    "UsageError": "streamck.errors",
    "checkpoint_manifest": "streamck.manifest",
    "plan_manifest": "streamck.manifest",
    "OutputTensor": "streamck.plan",
    "Plan": "streamck.plan",
    "Rule": "streamck.plan",
    "Rules": "streamck.plan",
    "compile_plan": "streamck.plan",
    "eagle4_plan": "streamck.plan",
    "load_rules": "streamck.plan",
    "Checkpoint": "streamck.source",
    "TensorRef": "streamck.source",
    "open_checkpoint": "streamck.source",
    "WriteResult": "streamck.writer",
    "write_plan": "streamck.writer",
}


def __getattr__(name: str) -> _Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'streamck' has no attribute {name!r}")
    value = getattr(_import_module(module), name)
    globals()[name] = value  # once imported, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*_EXPORTS, "__version__"})


__version__ = "0.1.0"

__all__ = sorted(_EXPORTS)
