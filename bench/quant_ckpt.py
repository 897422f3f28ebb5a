"""The `quant` bench's contender from llm-compressor, run as a child process:

python bench/quant_ckpt.py ptq SRC OUT SCHEME [IGNORE ...]   # llm-compressor 0.14's model_free_ptq on the CPU

(its bases are bench/lora_ckpt.py's bf16 Llama: widths that are multiples of 128, which
model_free_ptq's FP8_BLOCK needs to write without crashing.)
"""

from __future__ import annotations

import sys


def ptq(src: str, out: str, scheme: str, *ignore: str) -> None:
    from llmcompressor.entrypoints.model_free import model_free_ptq

    model_free_ptq(src, out, scheme=scheme, ignore=list(ignore), device="cpu")


if __name__ == "__main__":
    {"ptq": ptq}[sys.argv[1]](*sys.argv[2:])
