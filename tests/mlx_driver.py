"""Run inside the mlx venv (tests/mlx_env.py): a JSON list of jobs on stdin, one JSON list of
answers as the last line of stdout (mlx-lm's own prints go to stderr).

- ``{"op": "convert", "src", "dst", "quantize", "q_bits", "q_group_size", "q_mode", "dtype",
  "shard_bytes"}``: ``mlx_lm.convert.convert`` (the reference); ``shard_bytes`` cuts shards at that
  many bytes instead of 5 GiB (``make_shards`` with bytes for gigabytes, nothing else changed).
- ``{"op": "compare", "a", "b"}``: both folders' tensors as ``mx.load`` reads them (names, dtypes,
  shapes, bytes), their configs and indexes as parsed JSON, their shard names and file names.
- ``{"op": "quantize", "input", "dtype", "mode", "group_size", "bits", "save"}``: ``mx.quantize``'s bytes.
- ``{"op": "logits", "paths", "tokens", "save"}``: ``mlx_lm.load`` of each folder, the logits of
  ``tokens`` (with ``f32``, the model's floats made float32 first, as MLX's CPU runs MoE experts only
  so); the largest difference from the first folder's, which go to ``save`` (.npy, float32).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import sys
import time

import mlx.core as mx
import numpy as np


def convert(job: dict) -> dict:
    import mlx_lm.utils
    from mlx_lm.convert import convert as mlx_convert

    original = mlx_lm.utils.make_shards
    if job.get("shard_bytes"):
        limit = job["shard_bytes"]

        def make_shards(weights: dict, max_file_size_gb: int = 5) -> list:
            shards, size = [], 0
            for k, v in weights.items():
                if not shards or size + v.nbytes > limit:
                    shards.append({})
                    size = 0
                shards[-1][k] = v
                size += v.nbytes
            return shards

        mlx_lm.utils.make_shards = make_shards
    keys = ("quantize", "q_bits", "q_group_size", "q_mode", "dtype")
    try:
        mlx_convert(job["src"], job["dst"], **{k: job[k] for k in keys if k in job})
    finally:
        mlx_lm.utils.make_shards = original
    return {"files": sorted(os.listdir(job["dst"]))}


def tensors(folder: str) -> dict:
    out = {}
    for f in sorted(glob.glob(os.path.join(folder, "model*.safetensors"))):
        out.update(mx.load(f))
    return out


def _bytes(a: mx.array) -> bytes:
    return bytes(np.array(a.view(mx.uint8) if a.dtype != mx.bool_ else a.astype(mx.uint8)))


def compare(job: dict) -> dict:
    a, b = tensors(job["a"]), tensors(job["b"])
    differ = [k for k in sorted(set(a) & set(b)) if (a[k].dtype, a[k].shape) != (b[k].dtype, b[k].shape)]
    differ += [k for k in sorted(set(a) & set(b)) if k not in differ and _bytes(a[k]) != _bytes(b[k])]

    def read(folder: str, name: str):
        with open(os.path.join(folder, name)) as f:
            return json.load(f)

    return {
        "only_a": sorted(set(a) - set(b)),
        "only_b": sorted(set(b) - set(a)),
        "differ": differ,
        "count": len(a),
        "dtypes": sorted({str(v.dtype) for v in a.values()}),
        "config_equal": read(job["a"], "config.json") == read(job["b"], "config.json"),
        "index_equal": read(job["a"], "model.safetensors.index.json") == read(job["b"], "model.safetensors.index.json"),
        "files": [sorted(os.listdir(job["a"])), sorted(os.listdir(job["b"]))],
    }


def logits(job: dict) -> dict:
    from mlx_lm import load

    rows, encoded = [], []
    for path in job["paths"]:
        model, tokenizer = load(path)
        if job.get("f32"):  # MLX's CPU gather_mm (MoE experts) runs float32 only
            model.set_dtype(mx.float32)
        out = model(mx.array([job["tokens"]])).astype(mx.float32)
        rows.append(np.array(out[0]))
        encoded.append(tokenizer.encode("Hello world, 123"))
    if job.get("save"):
        np.save(job["save"], rows[0])
    worst = max((float(np.abs(r - rows[0]).max()) for r in rows[1:]), default=0.0)
    return {"max_diff": worst, "shape": list(rows[0].shape), "encoded": encoded}


def quantize(job: dict) -> dict:
    """``mx.quantize`` of the float32 rows in ``job["input"]`` (.npy) cast to ``dtype`` first, in
    ``mode`` with ``group_size`` and ``bits``; every output's bytes to ``job["save"]`` (.npz)."""
    w = mx.array(np.load(job["input"])).astype(getattr(mx, job["dtype"]))
    out = mx.quantize(w, group_size=job["group_size"], bits=job["bits"], mode=job["mode"])
    np.savez(job["save"], **{f"out{i}": np.array(a.view(mx.uint8)) for i, a in enumerate(out)})
    return {"outputs": len(out)}


OPS = {"convert": convert, "compare": compare, "logits": logits, "quantize": quantize}


def main() -> None:
    jobs = json.load(sys.stdin)
    answers = []
    with contextlib.redirect_stdout(sys.stderr):
        for job in jobs:
            started = time.monotonic()
            try:
                answers.append(OPS[job["op"]](job))
            except Exception as e:  # one job's failure is its answer; the others still run
                answers.append({"error": f"{type(e).__name__}: {e}"})
            where = job.get("dst") or job.get("a") or job.get("save")
            print(f"{job['op']} {where}: {time.monotonic() - started:.2f} s")  # to stderr: what took the time
    print(json.dumps(answers))


if __name__ == "__main__":
    main()
