"""streamck: rewrite safetensors checkpoints without holding them in memory.

One call per command::

    streamck.rewrite("llama-70b", "out", rules=[{"strip_prefix": "model."}], dtype="bf16")
    streamck.diff("golden.keys.json", "out")            # also ls(), hash()

or the data flow step by step, source → plan → writer::

    ckpt = open_checkpoint("llama-70b")                 # headers only
    plan = compile_plan(ckpt, Rules((Rule("strip_prefix", "model."),)))
    write_plan(plan, "out", WriteOptions(max_shard_size=5 * 10**9))  # bounded memory, atomic

or with the options as objects, each checked where it is made::

    streamck.rewrite(SourceSpec("run", step="latest"), "out", plan_options=PlanOptions(dtype="bf16"),
                     write_options=WriteOptions(max_shard_size="5GB", verify=True))
"""

from streamck._lazy import lazy_getattr as _lazy_getattr
from streamck.registry import BUILTINS as _BUILTINS

_PLAN_FUNCTIONS = sorted({b.function for b in _BUILTINS})

# The public names, by the module each lives in. They are imported on first use, so that
# ``streamck ls`` (or ``import streamck.source``) does not pay for the writer and the
# plans: a key-set check in CI should start in milliseconds.
_EXPORTS = {
    "streamck.api": ("build_plan", "diff", "export_eagle4_draft", "hash", "ls", "rewrite"),
    "streamck.errors": ("CheckpointError", "DeviceError", "OutputError", "PlanError", "StreamckError", "UsageError"),
    "streamck.manifest": ("checkpoint_manifest", "plan_manifest"),
    # the built-in plans' functions by the one table of them (streamck.registry)
    "streamck.plan": ("OutputTensor", "Plan", "Rule", "Rules", "compile_plan", "load_rules", *_PLAN_FUNCTIONS),
    "streamck.source": ("Checkpoint", "TensorRef", "open_checkpoint"),
    "streamck.spec": ("SourceSpec",),
    "streamck.plan.options": ("PlanOptions",),
    "streamck.writer": ("WriteOptions", "WriteResult", "write_plan"),
}
_MODULE = {name: module for module, names in _EXPORTS.items() for name in names}


__getattr__ = _lazy_getattr(__name__, globals(), _MODULE)


def __dir__() -> list[str]:
    return sorted({*_MODULE, "__version__"})


__version__ = "0.1.0"

__all__ = sorted(_MODULE)
