"""What streamck knows by name, as data: the built-in plans and the output formats.

The tables import nothing, so that the command line's help and completion can name them
without loading the plans or the writer (``streamck ls`` must start in milliseconds);
streamck.plan and streamck.writer.formats look their rows up here and import a row's
module only when it is asked for.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Builtin:
    """One built-in plan: its name, where its function lives, the SourceSpec options it takes
    besides the common ones, and what the CLI's help says it writes (empty: an alias, kept
    for an older spelling and left out of the help)."""

    name: str
    module: str
    function: str
    options: frozenset[str] = frozenset()
    writes: str = ""


# The one table of built-in plans: the CLI's help and completion, the options each takes and
# the package's lazy attributes all derive from it.
BUILTINS = (
    Builtin("eagle4", "streamck.plan.eagle4.plan", "eagle4_plan", writes="an EAGLE-4 draft's serving layout"),
    Builtin(
        "eagle3",
        "streamck.plan.eagle3.plan",
        "eagle3_plan",
        frozenset({"aux_layer_ids"}),
        "an EAGLE-3 draft as vLLM and SGLang load it",
    ),
    Builtin(
        "eagle3-speculators",
        "streamck.plan.eagle3.plan",
        "eagle3_speculators_plan",
        frozenset({"aux_layer_ids", "verifier"}),
        "an EAGLE-3 draft in speculators' layout",
    ),
    Builtin(
        "torchtitan",
        "streamck.plan.torchtitan.plan",
        "torchtitan_plan",
        frozenset({"hf_config"}),
        "a torchtitan step as a Hugging Face model",
    ),
    Builtin("torchtitan-llama3", "streamck.plan.torchtitan.plan", "torchtitan_plan", frozenset({"hf_config"})),
    Builtin(
        "megatron-gpt",
        "streamck.plan.megatron.plan",
        "megatron_plan",
        frozenset({"hf_config"}),
        "a Megatron torch_dist GPTModel as a Hugging Face model",
    ),
    Builtin(
        "olmo2",
        "streamck.plan.olmo2.plan",
        "olmo2_plan",
        frozenset({"hf_config"}),
        "an OLMo-core step as a Hugging Face OLMo 2 model",
    ),
)


@dataclass(frozen=True)
class OutputFormat:
    """One output format: its name (``--format``), the class implementing
    streamck.writer.formats.base.Format, and the file names that ask for it."""

    name: str
    module: str
    cls: str
    suffixes: tuple[str, ...]
    needs: tuple[str, ...] = ()  # the packages it imports beyond streamck's own (an extra)
    install: str = ""  # what to run where they are missing
    takes: tuple[str, ...] = ()  # the WriteOptions of its own (OWN_OPTIONS) that it reads


# WriteOptions that only some formats read: one set for another format is refused, not ignored.
OWN_OPTIONS = ("group_size", "make_vocab_size_divisible_by")


FORMATS = (
    OutputFormat("safetensors", "streamck.writer.formats.safetensors", "Safetensors", (".safetensors",)),
    OutputFormat("torch", "streamck.writer.formats.torch", "TorchArchive", (".bin", ".pt", ".pth")),
    OutputFormat(
        "gguf",
        "streamck.writer.formats.gguf.format",
        "GGUF",
        (".gguf",),
        needs=("gguf", "tokenizers"),
        install="pip install gguf==0.19.0 tokenizers (or pip install '.[gguf]' in a streamck checkout)",
    ),
    OutputFormat("mlx", "streamck.writer.formats.mlx.format", "MLX", (), takes=("group_size",)),
    OutputFormat(
        "megatron", "streamck.writer.formats.megatron.format", "Megatron", (), takes=("make_vocab_size_divisible_by",)
    ),
)
