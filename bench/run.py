"""streamck benchmarks: each contender a child process, wall time and peak RSS from the OS.

    python bench/run.py                 # every case at its default size (a few minutes)
    python bench/run.py rewrite --size 8GiB --reps 5
    python bench/run.py index
    python bench/run.py dcp --size 2GiB      # torch DCP (sharded safetensors, .distcp) -> one file
    python bench/run.py zero --size 1GiB     # DeepSpeed ZeRO-3 checkpoint-N -> safetensors
    python bench/run.py fsdp --size 2GiB     # Trainer + FSDP2 checkpoint-N -> safetensors
    python bench/run.py clone                # on a reflink XFS loop image (root), 2 and 16 GiB
    python bench/run.py titan megatron       # torchtitan / Megatron checkpoints -> Hugging Face (156 MiB models)
    python bench/run.py lora --size 1GiB     # --merge-lora vs PEFT's merge_and_unload (needs peft)
    python bench/run.py moe                  # FSDP2 save of a Qwen3-MoE (fused experts) -> per-expert HF
    python bench/run.py verl --size 1GiB     # verl FSDP actor -> bf16 safetensors vs verl's merger (its venv)
    python bench/run.py count                # DeepSeek-V3's layout, 1.6k to 140k tensors: time per tensor
    python bench/run.py remote --size 1GiB   # s3 -> local, s3 -> s3 (SeaweedFS on loopback) vs s3fs get + rewrite

Contenders run interleaved (A B C A B C) after a settle pause; the table gives
medians and ratios against the baseline of the same run, and is written into
bench/RESULTS.md between that case's markers.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

# The cases live in bench/cases/ (a module per family of them), what they share in bench/harness.py
# and bench/measure.py; this file parses the arguments and runs the cases asked for.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cases  # noqa: F401  (registers every case, in the order they run)
from harness import CASES, DEFAULT_SIZE, HERE, precompile, record


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cases", nargs="*", choices=[[], *CASES], default=[])
    p.add_argument(
        "--size",
        default=None,
        help="checkpoint size (default: 4GiB; dcp 2GiB, zero 1GiB); rewrite, cast, dcp also run a quarter-size one",
    )
    p.add_argument("--embed", default="1GiB", help="rewrite: the largest tensor")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--settle", type=float, default=10.0, help="seconds of idle before each timed child")
    p.add_argument("--shards", type=int, default=1000, help="index: shard count")
    p.add_argument("--tensors", type=int, default=100, help="index: tensors per shard")
    p.add_argument("--schemes", default="FP8_BLOCK,NVFP4A16", help="quant: the schemes, comma-separated")
    p.add_argument("--eagle-scale", type=int, default=2, help="eagle4: divide the 70B-target draft's sizes by this")
    p.add_argument("--layers", default="0,5,8,20,61,92", help="count: DeepSeek-V3 decoder layer counts")
    p.add_argument("--no-record", action="store_true", help="print only; leave RESULTS.md alone")
    a = p.parse_args()
    size = a.size
    precompile(HERE.parent)
    for name in a.cases or CASES:
        a.size = size or DEFAULT_SIZE[name]
        with tempfile.TemporaryDirectory(prefix=f"streamck-bench-{name}-", dir=os.environ.get("BENCH_DIR")) as tmp:
            print(f"== {name}: {CASES[name].__doc__}", file=sys.stderr)
            text = CASES[name](a, Path(tmp))
        print(f"\n## {name}\n\n{text}\n")
        if not a.no_record:
            record(name, text)


if __name__ == "__main__":
    main()
