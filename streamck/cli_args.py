"""The ``streamck`` command line: its parser, one subcommand per library entry point
(streamck.cli runs them)."""

from __future__ import annotations

import argparse
import difflib
import re

from streamck import __version__
from streamck.registry import BUILTINS, FORMATS


def _device(text: str) -> str:
    kind, _, index = text.partition(":")
    if not (text == "cpu" or (kind == "cuda" and (not index or index.isdigit()))):
        raise argparse.ArgumentTypeError(f"{text!r} is not cpu, cuda or cuda:N")
    return text


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is less than 1")
    return value


class _AddRule(argparse.Action):
    """Collect every rule option into one list, keeping the order they were given in."""

    def __call__(self, parser, namespace, value, option_string=None):
        from streamck.plan import Rule  # imported by the commands that take rules, not by ls

        namespace.rules = [*(namespace.rules or []), Rule(self.dest, value)]


def _plans(option: str | None = None) -> list[str]:
    """The built-in plans the help names (streamck.plan.BUILTINS, aliases left out), or
    those that take ``option``."""
    return [b.name for b in BUILTINS if b.writes and (option is None or option in b.options)]


def _source_options(parser: argparse.ArgumentParser, diff: bool = False) -> None:
    """What every command reads its source with (streamck.spec.SourceSpec's fields)."""
    group = parser.add_argument_group("source: which checkpoint, read how" + (" (both sides)" if diff else ""))
    group.add_argument("--step", help="in a training run root: a step number, or latest")
    group.add_argument(
        "--key",
        help="in a .pt/.bin: read only the dict under this top-level key (e.g. state_dict); "
        "in a DCP checkpoint: only the items under this prefix (model, app.model), the prefix taken off",
    )
    zero = "read DeepSpeed ZeRO state (fp32 master) over a weights file beside it"
    group.add_argument("--zero", action="store_true", help=zero)
    if diff:
        group.add_argument("--zero-a", action="store_true", help=f"{zero}, on side a only")
        group.add_argument("--zero-b", action="store_true", help=f"{zero}, on side b only")
    group.add_argument(
        "--keep-tied",
        action="store_true",
        help="from ZeRO or FSDP state: write a tied head (lm_head.weight) too, even where config.json ties it",
    )
    group.add_argument(
        "--plan",
        help=f"a built-in plan ({', '.join(_plans())}) or a TOML plan file (its rules come first); ls, diff and "
        "hash then show what the plan would write",
    )
    group.add_argument(
        "--hf-config",
        metavar="FILE",
        help=f"with --plan {' or '.join(_plans('hf_config'))}: the model's Hugging Face config.json, or its "
        "folder (its sizes; written beside the weights; GGUF and MLX output take the folder's tokenizer), over a "
        "config.json beside the step",
    )
    group.add_argument(
        "--verifier", metavar="ORG/NAME", help="with --plan eagle3-speculators: the target model it drafts for"
    )
    group.add_argument(
        "--remote-concurrency",
        type=_at_least_one,
        metavar="N",
        help="ranged requests (or part uploads) in flight per file of an s3:// URL; default 4, "
        "or STREAMCK_REMOTE_CONCURRENCY",
    )
    group.add_argument(
        "--aux-layer-ids",
        metavar="K,K,K",
        help="with --plan eagle3[-speculators]: the target layers whose outputs the draft was trained on "
        "(Automodel's ids), over what the step records",
    )


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage mistake reported like every other error: one line, exit 2
    (``--help`` still shows the usage); abbreviations refused (``--dtyp`` is a typo, not
    ``--dtype``, and a later option could make it ambiguous), close spellings suggested."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.commands: dict[str, argparse.ArgumentParser] = {}

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command = self.commands.get(getattr(parsed, "command", None), self)
            command.error(f"unrecognized arguments: {' '.join(extras)}{suggest(extras, options(command))}")
        return parsed

    def error(self, message: str):
        choice = INVALID_CHOICE.search(message)
        if choice:
            message += suggest([choice[1]], re.findall(r"'([^']*)'", choice[2]))
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# argparse's words for a value not among an argument's choices (Python 3.11 to 3.13).
INVALID_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)")


def options(parser: argparse.ArgumentParser) -> list[str]:
    """Every option string ``parser`` takes (``--dtype``, ``-o``)."""
    return [s for action in parser._actions for s in action.option_strings]


def suggest(given: list[str], known: list[str]) -> str:
    """``; did you mean --dtype?`` for the first of ``given`` close to one of ``known`` (a
    misspelling, or a prefix of exactly one), else ""."""
    for word in given:
        word = word.split("=", 1)[0]
        prefixed = [k for k in known if k.startswith(word) and len(word) > 2]
        close = prefixed if len(prefixed) == 1 else difflib.get_close_matches(word, known, n=1, cutoff=0.6)
        if close:
            return f"; did you mean {close[0]}?"
    return ""


# What every command exits with (docs/commands.md, "Exit status", says the same).
EXIT_STATUS = """exit status:
  0    done (diff: the two sides are the same)
  1    diff only: the two sides differ
  2    bad input, a refused plan or output, a failed write (one line on stderr; nothing left at the output)
  130  interrupted by Ctrl-C; 143, 129: stopped by SIGTERM, SIGHUP (nothing left at the output)"""
REWRITE_EXAMPLES = """examples:
  streamck rewrite ckpt/ -o out/ --strip-prefix model. --dtype bf16
      rename and cast a Hugging Face checkpoint into out/ (config and tokenizer copied along)
  streamck rewrite run/ --step latest --plan torchtitan --hf-config config.json -o hf/
      a trainer's step as a Hugging Face model (see ls run/ for the plan to use)
  streamck rewrite big/ -o out/ --max-shard-size 5GB --progress log --dry-run
      print the plan, write nothing; drop --dry-run to write it, a progress line every 10 s"""
# Where --progress auto shows a bar and where it writes log lines.
PROGRESS = ("auto", "bar", "log", "none")
SHELLS = ("bash", "zsh", "fish")


def _quiet(parser: argparse.ArgumentParser, more: str = "") -> None:
    """The -q every command takes: the same words, the same behaviour."""
    parser.add_argument("-q", "--quiet", action="store_true", help=f"only notes that ask for action{more}")


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: one subcommand per library entry point."""
    parser = _Parser(
        prog="streamck",
        description="Memory-streaming safetensors rewriter.",
        epilog=EXIT_STATUS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"streamck {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    parser.commands = sub.choices

    _ls_parser(sub)
    _rewrite_parser(sub)
    _diff_parser(sub)
    _hash_parser(sub)
    done = sub.add_parser("completion", help="print a shell completion script (bash, zsh, fish)")
    done.add_argument("shell", choices=SHELLS, help='e.g. eval "$(streamck completion bash)" in ~/.bashrc')
    return parser


def _ls_parser(sub) -> None:
    ls = sub.add_parser("ls", help="list every tensor of a checkpoint (headers only)")
    ls.add_argument("src", help="a .safetensors file or a checkpoint directory (or an s3:// URL of one)")
    ls.add_argument("--json", action="store_true", help="print the manifest as JSON")
    _quiet(ls)
    _source_options(ls)


def _rewrite_parser(sub) -> None:
    rw = sub.add_parser(
        "rewrite",
        help="rename, filter and cast into a new checkpoint, streaming",
        epilog=f"{REWRITE_EXAMPLES}\n\n{EXIT_STATUS}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    rw.add_argument("src", help="a .safetensors file or a checkpoint directory (or an s3:// URL of one)")
    rw.add_argument(
        "-o", "--output", help="OUT.safetensors (one file), a directory, an s3:// URL of either, or - for stdout"
    )
    _source_options(rw)
    _rule_options(rw)
    _plan_options(rw)
    _output_options(rw)
    _quiet(rw, "; no progress or summary")
    rw.set_defaults(rules=None)


def _rule_options(rw: argparse.ArgumentParser) -> None:
    """The rules, applied in the order given (streamck.plan.rules), and --dtype."""
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


def _plan_options(rw: argparse.ArgumentParser) -> None:
    """The plan's passes beyond the rules (streamck.plan.options.PlanOptions): experts, LoRA, quantization."""
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
    quant = rw.add_argument_group("quantizing for serving, as llm-compressor's model_free_ptq (needs torch)")
    quant.add_argument(
        "--quantize",
        metavar="SCHEME",
        help="FP8_DYNAMIC (per-row FP8 scales), FP8_BLOCK (128x128 blocks), NVFP4A16 (FP4, FP8 scales per 16 "
        "values and a global scale) or MXFP4A16 (FP4, E8M0 scales per 32 values); compressed-tensors format, as "
        "vLLM reads it. --dtype bf16 on a quantized source dequantizes instead",
    )
    quant.add_argument(
        "--group-size",
        type=int,
        metavar="N",
        help="--format mlx with MLX_Q4 or MLX_Q8: values per scale (32, 64 or 128; default 64), as mlx_lm's "
        "--q-group-size",
    )
    quant.add_argument(
        "--quantize-ignore",
        metavar="PATTERN",
        action="append",
        help="a module left unquantized (repeatable): a name, or re:REGEX matched from the start; added to the "
        "defaults (lm_head, the input embeddings, 're:.*mlp.gate$' for a MoE router; norms are never quantized)",
    )
    quant.add_argument(
        "--quantize-lm-head",
        action="store_true",
        help="quantize lm_head too (for servers that run it quantized); it is left out by default",
    )
    quant.add_argument(
        "--quantize-pad-partial",
        action="store_true",
        help="FP8_BLOCK: quantize a weight whose sides are no multiple of 128 padded, as model_free_ptq does "
        "(transformers cannot load it; vLLM can); by default such a weight is left unquantized, with a note",
    )


def _output_options(rw: argparse.ArgumentParser) -> None:
    """How the output is written (streamck.writer.options.WriteOptions), and what is printed."""
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
        choices=[f.name for f in FORMATS],
        help="a directory output's files: model*.safetensors (default) or torch.save pytorch_model*.bin; "
        "a file output's name decides (.safetensors, or .bin/.pt/.pth); megatron: a Megatron-LM torch_dist run "
        "root for --load RUN --finetune",
    )
    rw.add_argument("--header-align", type=int, default=8, metavar="N", help="start the data area at a multiple of N")
    rw.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        metavar="N",
        help="--format megatron: pad the vocabulary with zero rows to a multiple of N, as Megatron-LM's flag (128)",
    )
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
    rw.add_argument(
        "--strict", action="store_true", help="a lossy cast (finite values become inf) is an error, not a warning"
    )
    rw.add_argument(
        "--progress",
        choices=PROGRESS,
        help="auto (the default): a bar on a terminal, else a log line every 10 s (batch jobs); -q: none",
    )


def _diff_parser(sub) -> None:
    df = sub.add_parser(
        "diff",
        help="compare key sets of checkpoints or manifests (exit 1 when they differ)",
        epilog=EXIT_STATUS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    df.add_argument("a", help="checkpoint (any layout; safetensors at an s3:// URL) or manifest JSON")
    df.add_argument("b", help="checkpoint (any layout; safetensors at an s3:// URL) or manifest JSON")
    df.add_argument("--ignore", action="append", metavar="GLOB", help="leave matching names out")
    df.add_argument("--data", action="store_true", help="also compare tensor bytes (checkpoints only)")
    df.add_argument("--json", action="store_true", help="print the result as JSON")
    _quiet(df, "; nothing when the sides agree")
    _source_options(df, diff=True)


def _hash_parser(sub) -> None:
    hs = sub.add_parser("hash", help="sha256 of every tensor, streamed")
    hs.add_argument("src", help="a .safetensors file or a checkpoint directory (or an s3:// URL of one)")
    hs.add_argument("--json", action="store_true", help="print a hash manifest (diff accepts it)")
    hs.add_argument("-o", "--output", help="write to this file instead of stdout")
    _quiet(hs)
    _source_options(hs)
