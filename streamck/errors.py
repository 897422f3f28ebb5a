"""The one exception type users of the library need to catch."""

from __future__ import annotations

import os


def listing(items: list[str], limit: int = 8) -> str:
    """``a, b, c, … (N in all)``: a list for a one-line message, cut at ``limit`` items."""
    more = f", … ({len(items)} in all)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


# An option a message names, as the library's caller spells it and as the command line does: a
# message holds the mark, ``str()`` says the first spelling, ``cli()`` the second. A mark in FLAGS
# is the name of a library parameter in braces (a field of SourceSpec, PlanOptions or WriteOptions,
# a keyword of streamck.diff, or a rule's kind in ``rules=[{"cast": ...}]``): ``{max_shard_size}``
# says ``max_shard_size`` to a library caller and ``--max-shard-size`` on the command line. The
# rest are flags whose library spelling is a value (``--keep-fused`` is ``experts="keep"``).
FLAGS = (
    # WriteOptions
    "max_shard_size", "keep_shards", "header_align", "verify", "strict", "device", "jobs", "part", "progress",
    "format", "drop_cache", "group_size", "make_vocab_size_divisible_by",
    # SourceSpec
    "remote_concurrency", "plan", "step", "key", "zero", "keep_tied", "hf_config", "verifier", "aux_layer_ids",
    # PlanOptions
    "dtype", "quantize", "quantize_ignore", "quantize_lm_head", "quantize_pad_partial",
    "merge_lora", "safe_merge", "merge_engine", "merge_lora_any_base",
    # streamck.diff; the rules' kinds
    "ignore", "data", "cast", "rename",
)  # fmt: skip
OPTIONS = {
    "{force}": ("force=True", "--force"),
    "{keep_fused}": ('experts="keep"', "--keep-fused"),
    "{fuse_experts}": ('experts="fuse"', "--fuse-experts"),
    **{f"{{{name}}}": (name, "--" + name.replace("_", "-")) for name in FLAGS},
}


def spelled(text: str, cli: bool = False) -> str:
    """``text`` with its OPTIONS marks as a library caller reads them, or with ``cli`` as the
    command line's flags (what a notice says: the CLI prints notices as they are)."""
    for mark, spellings in OPTIONS.items():
        text = text.replace(mark, spellings[cli])
    return text


# What a message tells a user who lacks torch: the package itself (the registry has no streamck[cast]).
TORCH_HINT = (
    "pip install torch (the CPU build: add --index-url https://download.pytorch.org/whl/cpu; "
    "or pip install '.[cast]' in a streamck checkout)"
)


class StreamckError(Exception):
    """Bad input, a refused plan or a failed write; ``str()`` is one line a user can act on,
    ``cli()`` the same line with options spelled as the command line takes them."""

    def __init__(self, message: str, path: str | os.PathLike | None = None):
        self.path = None if path is None else os.fspath(path)
        self.message = message  # with OPTIONS' marks, kept when a message is wrapped in another
        super().__init__(self._render(False))

    def _render(self, cli: bool) -> str:
        text = spelled(self.message, cli)
        return f"{self.path}: {text}" if self.path else text

    def cli(self) -> str:
        """The message as the command line says it (``--force``, not ``force=True``)."""
        return self._render(True)


class CheckpointError(StreamckError):
    """A source file or index that violates the format."""


class PlanError(StreamckError):
    """Rules that cannot be compiled against the source: collisions, bad patterns, refusals."""


class OutputError(StreamckError):
    """An output path that is refused, or a write that failed."""


class UsageError(StreamckError):
    """An argument the caller got wrong: a size, a dtype spelling, options that exclude each other."""


class DeviceError(StreamckError):
    """The device asked to cast on is missing, out of memory, or failed."""


class Info(str):
    """A notice that needs no action (non-tensor items skipped): ``rewrite -q`` leaves it out."""
