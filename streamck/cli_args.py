"""The ``streamck`` command line: its parser, one subcommand per library entry point
(streamck.cli runs them)."""

from __future__ import annotations

import argparse

from streamck import __version__


def _device(text: str) -> str:
    kind, _, index = text.partition(":")
    if not (text == "cpu" or (kind == "cuda" and (not index or index.isdigit()))):
        raise argparse.ArgumentTypeError(f"{text!r} is not cpu, cuda or cuda:N")
    return text


class _AddRule(argparse.Action):
    """Collect every rule option into one list, keeping the order they were given in."""

    def __call__(self, parser, namespace, value, option_string=None):
        from streamck.plan import Rule  # imported by the commands that take rules, not by ls

        namespace.rules = [*(namespace.rules or []), Rule(self.dest, value)]


def _source_options(parser: argparse.ArgumentParser, diff: bool = False) -> None:
    if not diff:
        parser.add_argument("--step", help="in a training run root: a step number, or latest")
    parser.add_argument(
        "--key",
        help="in a .pt/.bin: read only the dict under this top-level key (e.g. state_dict); "
        "in a DCP checkpoint: only the items under this prefix (model, app.model), the prefix taken off",
    )
    zero = "read DeepSpeed ZeRO state (fp32 master) over a weights file beside it"
    parser.add_argument("--zero", action="store_true", help=zero + (" (both sides)" if diff else ""))
    if diff:
        parser.add_argument("--zero-a", action="store_true", help=f"{zero}, on side a only")
        parser.add_argument("--zero-b", action="store_true", help=f"{zero}, on side b only")
    parser.add_argument(
        "--keep-tied",
        action="store_true",
        help="from ZeRO or FSDP state: write a tied head (lm_head.weight) too, even where config.json ties it",
    )


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage mistake reported like every other error: one line, exit 2
    (``--help`` still shows the usage)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="streamck", description="Memory-streaming safetensors rewriter.")
    parser.add_argument("--version", action="version", version=f"streamck {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    ls = sub.add_parser("ls", help="list every tensor of a checkpoint (headers only)")
    ls.add_argument("src", help="a .safetensors file or a checkpoint directory")
    ls.add_argument("--json", action="store_true", help="print the manifest as JSON")
    _source_options(ls)

    rw = sub.add_parser("rewrite", help="rename, filter and cast into a new checkpoint, streaming")
    rw.add_argument("src", help="a .safetensors file or a checkpoint directory")
    rw.add_argument("-o", "--output", help="OUT.safetensors (one file), a directory, or - for stdout")
    _source_options(rw)
    rules = rw.add_argument_group("rules, applied in the order given")
    rules.add_argument("--strip-prefix", dest="strip_prefix", metavar="P", action=_AddRule)
    rules.add_argument("--add-prefix", dest="add_prefix", metavar="P", action=_AddRule)
    rules.add_argument(
        "--rename",
        dest="rename",
        metavar="REGEX=REPL",
        action=_AddRule,
        help="re.sub on the name; \\1 refers to groups",
    )
    rules.add_argument("--drop", dest="drop", metavar="GLOB", action=_AddRule, help="drop source names matching")
    rules.add_argument(
        "--keep", dest="keep", metavar="GLOB", action=_AddRule, help="keep only source names matching (any --keep)"
    )
    rules.add_argument(
        "--cast",
        dest="cast",
        metavar="GLOB=DTYPE",
        action=_AddRule,
        help="cast matching floating tensors; wins over --dtype, last match wins",
    )
    rules.add_argument("--dtype", help="cast every F64/F32/F16/BF16 tensor (bf16, fp16, float32, ...)")
    rules.add_argument(
        "--plan",
        help="a built-in plan (eagle4, eagle3, eagle3-speculators, torchtitan (alias torchtitan-llama3), "
        "megatron-gpt) or a TOML plan file (its rules come first)",
    )
    rules.add_argument(
        "--hf-config",
        metavar="FILE",
        help="with --plan torchtitan or megatron-gpt: the model's Hugging Face config.json (its sizes; "
        "written beside the weights), over a config.json beside the step",
    )
    rules.add_argument(
        "--verifier", metavar="ORG/NAME", help="with --plan eagle3-speculators: the target model it drafts for"
    )
    rules.add_argument(
        "--aux-layer-ids",
        metavar="K,K,K",
        help="with --plan eagle3[-speculators]: the target layers whose outputs the draft was trained on "
        "(Automodel's ids), over what the step records",
    )
    moe = rw.add_argument_group("Mixture-of-Experts (default: per expert, as save_pretrained writes them)")
    moe_way = moe.add_mutually_exclusive_group()
    moe_way.add_argument(
        "--keep-fused",
        dest="experts",
        action="store_const",
        const="keep",
        default="auto",
        help="write fused runtime experts (experts.gate_up_proj/down_proj) as the trainer saved them",
    )
    moe_way.add_argument(
        "--fuse-experts",
        dest="experts",
        action="store_const",
        const="fuse",
        help="write per-expert tensors fused, as transformers 5 runs them (needs config.json)",
    )
    lora = rw.add_argument_group("merging a PEFT LoRA adapter (needs torch)")
    lora.add_argument("--merge-lora", metavar="ADAPTER", help="merge this adapter folder in (as merge_and_unload)")
    lora.add_argument("--safe-merge", action="store_true", help="as PEFT's safe_merge: refuse non-finite results")
    lora.add_argument("--merge-lora-any-base", action="store_true", help="skip the base_model_name_or_path check")
    engines = "torch (the default where installed: PEFT's bits) or numpy (not bit for bit)"
    lora.add_argument("--merge-engine", choices=("torch", "numpy"), help=engines)
    rw.add_argument("--dry-run", action="store_true", help="print the compiled plan, write nothing")
    rw.add_argument(
        "--json", action="store_true", help="print the output manifest (with --dry-run) or a JSON report of the run"
    )
    rw.add_argument("--max-shard-size", metavar="SIZE", help="split into shards (5GB, 500MiB)")
    rw.add_argument("--jobs", type=int, default=1, metavar="N", help="write N output shards at once (threads)")
    rw.add_argument(
        "--part",
        metavar="K/N",
        help="write only part K of N of the output's shards (plus index and side files): N hosts, one output",
    )
    rw.add_argument(
        "--format",
        choices=("safetensors", "torch"),
        help="a directory output's files: model*.safetensors (default) or torch.save pytorch_model*.bin; "
        "a file output's name decides (.safetensors, or .bin/.pt/.pth)",
    )
    rw.add_argument("--header-align", type=int, default=8, metavar="N", help="start the data area at a multiple of N")
    rw.add_argument(
        "--keep-shards",
        action="store_true",
        help="one output file per source file, tensors in the source's order (shared, not copied, on XFS/btrfs)",
    )
    rw.add_argument("--drop-cache", action="store_true", help="release read and written pages from the page cache")
    rw.add_argument(
        "--device", type=_device, default=None, metavar="cpu|cuda[:N]", help="where casts run (default cpu)"
    )
    rw.add_argument("--force", action="store_true", help="replace an existing output")
    rw.add_argument("--no-copy-files", action="store_true", help="do not copy config and tokenizer files along")
    rw.add_argument("--verify", action="store_true", help="re-read the output and check it against the source")
    rw.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary")
    rw.set_defaults(rules=None)

    df = sub.add_parser("diff", help="compare key sets of checkpoints or manifests (exit 1 when they differ)")
    df.add_argument("a", help="checkpoint (any layout) or manifest JSON")
    df.add_argument("b", help="checkpoint (any layout) or manifest JSON")
    df.add_argument("--ignore", action="append", metavar="GLOB", help="leave matching names out")
    df.add_argument("--data", action="store_true", help="also compare tensor bytes (checkpoints only)")
    df.add_argument("--json", action="store_true", help="print the result as JSON")
    _source_options(df, diff=True)

    hs = sub.add_parser("hash", help="sha256 of every tensor, streamed")
    hs.add_argument("src", help="a .safetensors file or a checkpoint directory")
    hs.add_argument("--json", action="store_true", help="print a hash manifest (diff accepts it)")
    hs.add_argument("-o", "--output", help="write to this file instead of stdout")
    _source_options(hs)
    return parser
