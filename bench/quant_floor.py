"""The `quant` bench's floor: what the arithmetic alone costs on this machine, no files read or written.

python bench/quant_floor.py SRC SCHEME   # prints {"arithmetic": s, "one_cast": s} as JSON

The weights ``--quantize SCHEME`` targets (its defaults: not lm_head, not the embeddings) are loaded into memory first
(untimed); then, timed, streamck's own band functions (streamck.transforms.quantize / fp4) compute
every output from them, and, for comparison, a single ``Tensor.to(float8_e4m3fn)`` pass over the
same weights: the least any FP8 cast with torch on the CPU can take. A streamck run close to
``arithmetic`` plus a ``cp`` is at the floor of this arithmetic on this machine.
"""

from __future__ import annotations

import json
import sys
import time

import torch
from safetensors.torch import load_file

from streamck.plan.quant.layout import EMBEDDINGS
from streamck.transforms import fp4, quantize


def _targets(src: str) -> list[torch.Tensor]:
    from pathlib import Path

    out = []
    for path in sorted(Path(src).glob("*.safetensors")):
        for name, t in load_file(path).items():
            module = name.removesuffix(".weight")
            kept = module == "lm_head" or module.rpartition(".")[2] in EMBEDDINGS  # the defaults' ignore list
            if name.endswith(".weight") and t.dim() == 2 and not module.endswith("norm") and not kept:
                out.append(t)
    return out


def _bands(t: torch.Tensor, rows: int):
    for start in range(0, t.shape[0], rows):
        yield t[start : start + rows]


def arithmetic(weights: list[torch.Tensor], scheme: str) -> None:
    for w in weights:
        if scheme.startswith("FP8"):
            strategy = "block" if scheme == "FP8_BLOCK" else "channel"
            rows = quantize.band_rows(*w.shape, 2, strategy)[0][1]
            for block in _bands(w, rows):
                scale = quantize._scales(block, strategy)
                quantize._quantize(block, scale, strategy).contiguous()
            continue
        rows = max(1, fp4.FP4_BAND // (w.shape[1] * 2))
        if scheme == "NVFP4A16":
            gs = (fp4.FP8_MAX * fp4.FP4_MAX / w.abs().amax().float()).reshape(1)
            for block in _bands(w, rows):
                scale = fp4.nv_scales(block, gs)
                fp4.pack(fp4.nv_values(block, scale, gs))
        else:
            for block in _bands(w, rows):
                fp4.pack(fp4.mx_values(block, fp4.mx_scales(block)))


def main(src: str, scheme: str) -> None:
    weights = _targets(src)
    t0 = time.perf_counter()
    arithmetic(weights, scheme)
    t1 = time.perf_counter()
    for w in weights:
        w.to(torch.float8_e4m3fn)
    t2 = time.perf_counter()
    print(json.dumps({"arithmetic": t1 - t0, "one_cast": t2 - t1}))


if __name__ == "__main__":
    main(*sys.argv[1:])
