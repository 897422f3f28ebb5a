"""gpt-oss in the published MXFP4 layout (bench/gptoss_ckpt.py: a layer or two of 128 experts, each
MXFP4 stack over 256 MiB) to GGUF against llama.cpp's convert_hf_to_gguf.py (its MXFP4 experts repacked
into GGML's MXFP4; the files compared byte for byte) and to MLX against mlx_lm.convert (the experts
kept packed; the outputs compared tensor for tensor), both beside cp -r + sync of the model: time
and peak RSS, the point being the memory an expert stack costs each."""

from __future__ import annotations

import argparse
import filecmp
import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from harness import HERE, PY, case, contend, cp_fsync, dir_bytes, mib, peak_at, run_child, streamck, table

BASE = "cp -r + sync (model)"
GGUF = ("streamck bf16 (experts MXFP4)", "convert_hf_to_gguf bf16")  # the contenders compared
MLX = ("streamck --format mlx", "mlx_lm.convert")
EXPERTS, INTER, HIDDEN = 128, 16416, 256  # bench/gptoss_ckpt.py's defaults: stacks of 272.5 MiB


def _model(tmp: Path, layers: int, experts: int = EXPERTS) -> tuple[Path, Path, str]:
    """bench/gptoss_ckpt.py's model of ``layers`` layers and ``experts`` experts in ``tmp/gpt-oss``
    (the folder's name is the GGUF's general.name), llama.cpp's folder, and a sentence on its stacks."""
    from cases.gguf import _llama_cpp

    llama_cpp, base = _llama_cpp(), tmp / "gpt-oss"
    sizes = (str(experts), str(INTER), str(HIDDEN), str(layers))
    subprocess.run([PY, str(HERE / "gptoss_ckpt.py"), str(llama_cpp), str(base), *sizes], check=True)
    config = json.loads((base / "config.json").read_text())
    e, h, i = (config[k] for k in ("num_local_experts", "hidden_size", "intermediate_size"))
    stack, slice_ = e * i * h * 17 // 32, i * h * 17 // 32  # GGML MXFP4: 17 bytes per 32 values
    about = (
        f"bench/gptoss_ckpt.py's gpt-oss ({layers} layer{'s' * (layers > 1)}, hidden {h}, {e} experts of "
        f"intermediate {i}; vocab {config['vocab_size']}, untied head), {dir_bytes(base) / 2**30:.2f} GiB in the "
        f"published MXFP4 layout: gate_up_proj_blocks {_mib(e * 2 * i * h // 2)}, down_proj_blocks "
        f"{_mib(e * i * h // 2)} a layer, each expert stack (gate, up, down) {_mib(stack)} a layer (GGUF's MXFP4 "
        f"tensor; MLX's weight and scales together), one expert's slice of it {_mib(slice_)}"
    )
    return base, llama_cpp, about


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"  # one decimal: whether a stack is over 256 MiB shows


def _quarter_peaks(tmp: Path, layers: int, make: Callable[[Path], dict], labels: tuple[str, ...], settle: float) -> str:
    """A line: the peak RSS of the contenders ``labels`` (of ``make(model)``) on the same model with
    a quarter of the experts, each run once more, settled (streamck's must not grow with the stacks)."""
    small, _, _ = _model(tmp / "quarter", layers, EXPERTS // 4)
    contenders, out = make(small), tmp / "quarter-out"
    peaks = [f"{label} {mib(peak_at(contenders[label](out), out, settle))}" for label in labels]
    shutil.rmtree(small)
    stack = _mib(EXPERTS // 4 * INTER * HIDDEN * 17 // 32)
    return f"Peak RSS at a quarter of the experts ({EXPERTS // 4}, stacks of {stack}): {', '.join(peaks)}."


def _in_folder(cmd: list[str], out: Path) -> list[str]:
    """``cmd`` run after making ``out`` (contend removes the folder after each run)."""
    return ["sh", "-c", f'mkdir -p "{out}" && exec "$@"', "sh", *cmd]


@case(size="1GiB")
def case_gguf_gptoss(a: argparse.Namespace, tmp: Path) -> str:
    """gpt-oss's MXFP4 experts (three stacks of 272 MiB) to GGUF (bf16 file type, experts MXFP4):
    streamck (a band of blocks at a time) vs convert_hf_to_gguf.py (every repacked stack held
    until the file is written), both against cp -r + sync of the model."""
    from cases.gguf import _floor

    base, llama_cpp, about = _model(tmp, 1)
    ref = str(llama_cpp / "convert_hf_to_gguf.py")

    def make(model: Path) -> dict:
        return {
            BASE: cp_fsync(model),
            "floor: header + cp": _floor(model),
            GGUF[0]: lambda o: _in_folder(
                streamck("rewrite", str(model), "-o", f"{o}/model.gguf", "-q", "--dtype", "bf16"), o
            ),
            GGUF[1]: lambda o: _in_folder(
                [PY, ref, str(model), "--outfile", f"{o}/model.gguf", "--outtype", "bf16"], o
            ),
        }

    contenders = make(base)
    runs = contend(contenders, tmp / "out", a.reps, a.settle, (base,))
    quarter = _quarter_peaks(tmp, 1, make, GGUF, a.settle)
    files = []
    for label in GGUF:
        out = tmp / label.split()[0]
        run_child(contenders[label](out), 0)
        files.append(out / "model.gguf")
    verdict = "byte for byte equal" if filecmp.cmp(*files, shallow=False) else "NOT equal"
    return (
        f"Model: {about}; its tokenizer from llama.cpp's llama-bpe test vocabulary. {a.reps} interleaved reps, "
        f"{a.settle:.0f} s settle. Files ({files[0].stat().st_size / 2**30:.2f} GiB): {verdict}. {quarter}\n\n"
        + table(runs, BASE, dir_bytes(base))
    )


def _hub_rope(base: Path) -> None:
    """The Hub's ``rope_theta`` and ``rope_scaling`` beside transformers 5's ``rope_parameters`` in
    ``base``'s config.json: mlx-lm 0.32.2 reads the former only (tests/mlx_gptoss_models.py)."""
    path = base / "config.json"
    config = json.loads(path.read_text())
    rope = dict(config["rope_parameters"])
    config |= {"rope_theta": rope.pop("rope_theta"), "rope_scaling": rope}
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


@case(size="1GiB")
def case_mlx_gptoss(a: argparse.Namespace, tmp: Path) -> str:
    """gpt-oss's MXFP4 experts (two layers of three stacks of 272 MiB) to MLX (experts kept MXFP4,
    the rest bf16): streamck (a band of blocks at a time) vs mlx_lm.convert (each stack loaded
    whole), both against cp -r + sync of the model."""
    from cases.mlx import mlx_python, run_jobs

    base, _, about = _model(tmp, 2)  # mlx-lm's gpt-oss needs a sliding and a full attention layer
    mlx = str(mlx_python())

    def make(model: Path) -> dict:
        _hub_rope(model)
        return {
            BASE: cp_fsync(model),
            MLX[0]: lambda o: streamck("rewrite", str(model), "-o", str(o), "-q", "--format", "mlx"),
            MLX[1]: lambda o: [mlx, "-m", "mlx_lm", "convert", "--hf-path", str(model), "--mlx-path", str(o)],
        }

    contenders = make(base)
    runs = contend(contenders, tmp / "out", a.reps, a.settle, (base,))
    quarter = _quarter_peaks(tmp, 2, make, MLX, a.settle)
    outs = {label: tmp / label.split()[0] for label in MLX}
    for label, out in outs.items():
        run_child(contenders[label](out), 0)
    ours, theirs = outs.values()
    compared = run_jobs([{"op": "compare", "a": str(ours), "b": str(theirs)}])[0]
    same = not (compared.get("error") or compared["only_a"] or compared["only_b"] or compared["differ"])
    same = same and compared["config_equal"] and compared["index_equal"]
    verdict = f"{compared.get('count', 0)} tensors {'equal (names, dtypes, shapes, bytes)' if same else 'NOT equal'}"
    return (
        f"Model: {about}; the Hub's rope_theta and rope_scaling added to config.json for mlx-lm. {a.reps} "
        f"interleaved reps, {a.settle:.0f} s settle. Output {dir_bytes(ours) / 2**20:.0f} MiB; outputs: {verdict}, "
        f"config.json {'equal' if compared.get('config_equal') else 'NOT equal'}. {quarter}\n\n"
        + table(runs, BASE, dir_bytes(base))
    )
