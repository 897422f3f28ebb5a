"""--format mlx --quantize MLX_Q4 against mlx-lm's own converter (``mlx_lm.convert -q``, mlx 0.32.4 on
Linux CPUs, in the tests' mlx venv) and cp -r of the model: time and peak RSS, the outputs compared
tensor by tensor as mx.load reads them."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from harness import HERE, PY, case, contend, cp_fsync, dir_bytes, run_child, streamck, table

CACHE = Path.home() / ".cache" / "streamck-bench"
PINS = ("mlx[cpu]==0.32.4", "mlx-lm==0.32.2", "transformers==5.19.0")  # tests/mlx_env.py's


def mlx_python() -> Path:
    """The python of a venv holding mlx (CPU) and mlx-lm, made once per machine in the bench's cache."""
    where = CACHE / "venv-mlx-0.32.4-lm-0.32.2"
    if not (where / "done").exists():
        subprocess.run([PY, "-m", "venv", "--clear", str(where)], check=True, timeout=300)
        subprocess.run([str(where / "bin" / "python"), "-m", "pip", "install", "-q", *PINS], check=True, timeout=900)
        (where / "done").touch()
    return where / "bin" / "python"


def run_jobs(jobs: list[dict]) -> list:
    """The tests' mlx driver (tests/mlx_driver.py, run as a script in the mlx venv) on ``jobs``."""
    cmd = [str(mlx_python()), str(HERE.parent / "tests" / "mlx_driver.py")]
    proc = subprocess.run(cmd, input=json.dumps(jobs), capture_output=True, text=True, timeout=900, check=True)
    return json.loads(proc.stdout.splitlines()[-1])


@case(size="1GiB")
def case_mlx(a: argparse.Namespace, tmp: Path) -> str:
    """A bf16 Llama 3 (its embeddings and head 525 MB each) to MLX 4-bit (affine, groups of 64):
    streamck vs mlx_lm.convert -q, both against cp -r + sync of the model."""
    from cases.gguf import _llama_cpp

    base, mlx = tmp / "llama3", str(mlx_python())
    subprocess.run([PY, str(HERE / "gguf_ckpt.py"), str(_llama_cpp()), "llama", str(base), "2048", "2"], check=True)
    contenders = {
        "cp -r + sync (model)": cp_fsync(base),
        "streamck MLX_Q4": lambda o: [*streamck("rewrite", str(base), "-o", str(o), "-q", "--format", "mlx",
                                                "--quantize", "MLX_Q4")],
        "mlx_lm.convert -q": lambda o: [mlx, "-m", "mlx_lm", "convert", "--hf-path", str(base), "--mlx-path", str(o),
                                        "-q"],
    }  # fmt: skip
    runs = contend(contenders, tmp / "out", a.reps, a.settle, (base,))
    verdict = _verdict(contenders, tmp)
    return (
        f"Model: bench/gguf_ckpt.py's Llama 3 (hidden 2048, 2 layers, vocab 128256, untied head), "
        f"{dir_bytes(base) / 2**30:.2f} GiB bf16; output {dir_bytes(tmp / 'streamck') / 2**20:.0f} MiB. "
        f"{a.reps} interleaved reps, {a.settle:.0f} s settle. Outputs: {verdict}.\n\n"
        + table(runs, "cp -r + sync (model)", dir_bytes(base))
    )


@case(size="1GiB")
def case_mlx_moe(a: argparse.Namespace, tmp: Path) -> str:
    """A Qwen3-MoE layer of 16 experts of 16 MiB each (three stacked tensors of 256.5 MiB) to MLX
    4-bit: streamck (one band of an expert's rows at a time) vs mlx_lm.convert -q (each stack whole)."""
    from cases.gguf import _llama_cpp

    base, mlx = tmp / "qwen3moe", str(mlx_python())
    inter = 16 * 2**20 // 128 + 64  # an expert slice: inter x 64 bf16 values, 16 MiB; a multiple of 64 wide
    cmd = [PY, str(HERE / "gguf_ckpt.py"), str(_llama_cpp()), "stacks", str(base), "16", str(inter)]
    subprocess.run(cmd, check=True)
    config = json.loads((base / "config.json").read_text())  # the keys the Hub's Qwen3-MoE configs hold, which
    config |= {"decoder_sparse_step": 1, "mlp_only_layers": []}  # mlx-lm needs (its ModelArgs has no defaults)
    (base / "config.json").write_text(json.dumps(config))
    contenders = {
        "cp -r + sync (model)": cp_fsync(base),
        "streamck MLX_Q4": lambda o: [*streamck("rewrite", str(base), "-o", str(o), "-q", "--format", "mlx",
                                                "--quantize", "MLX_Q4")],
        "mlx_lm.convert -q": lambda o: [mlx, "-m", "mlx_lm", "convert", "--hf-path", str(base), "--mlx-path", str(o),
                                        "-q"],
    }  # fmt: skip
    runs = contend(contenders, tmp / "out", a.reps, a.settle, (base,))
    return (
        f"Model: bench/gguf_ckpt.py's `stacks` Qwen3-MoE (one layer, hidden 64, 16 experts of {inter} rows: "
        f"gate, up and down each stacked into a {16 * inter * 128 / 2**20:.1f} MiB switch_mlp tensor), "
        f"{dir_bytes(base) / 2**30:.2f} GiB bf16. {a.reps} interleaved reps, {a.settle:.0f} s settle. "
        f"Outputs: {_verdict(contenders, tmp)}.\n\n" + table(runs, "cp -r + sync (model)", dir_bytes(base))
    )


def _verdict(contenders: dict, tmp: Path) -> str:
    """streamck's and mlx_lm.convert's folders written once more and compared as mx.load reads them."""
    outs = {label: tmp / label.split()[0] for label in ("streamck MLX_Q4", "mlx_lm.convert -q")}
    for label, out in outs.items():
        run_child(contenders[label](out), 0)
    compared = run_jobs([{"op": "compare", "a": str(outs["streamck MLX_Q4"]), "b": str(outs["mlx_lm.convert -q"])}])[0]
    same = not (compared.get("error") or compared["only_a"] or compared["only_b"] or compared["differ"])
    same = same and compared["config_equal"] and compared["index_equal"]
    return f"{compared.get('count', 0)} tensors {'equal (names, dtypes, shapes, bytes)' if same else 'NOT equal'}"
