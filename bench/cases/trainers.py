"""Trainers' checkpoints against the trainers' own converters: DeepSpeed ZeRO-3 (zero_to_fp32.py),
torchtitan (convert_to_hf.py's route) and Megatron-LM (load, split, save as Megatron Bridge does)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
from collections.abc import Callable
from pathlib import Path

from harness import HERE, PY, case, chart, contend, cp_fsync, dir_bytes, parse_size, streamck, table

HUB_DIR = Path(os.environ.get("BENCH_PYDEPS", Path.home() / ".cache" / "streamck-bench" / "pydeps"))
HUB_INSTALL = f"{PY} -m pip install --no-deps --target {HUB_DIR} huggingface_hub"


def _hub_pythonpath() -> str | None:
    """zero_to_fp32.py's CLI needs huggingface_hub (its --max_shard_size, default 5GB, always
    imports it). The venv lacks it: a copy installed by HUB_INSTALL, outside the venv, is put on
    PYTHONPATH for those contenders only. None when neither has it."""
    for extra in ("", str(HUB_DIR)):
        env = {**os.environ, "PYTHONPATH": extra} if extra else None
        if subprocess.run([PY, "-c", "import huggingface_hub"], env=env, capture_output=True).returncode == 0:
            return extra
    return None


@case(size="1GiB")
def case_zero(a: argparse.Namespace, tmp: Path) -> str:
    """DeepSpeed ZeRO-3 (fp32, 2 ranks) checkpoint-N -> consolidated weights: zero_to_fp32.py vs streamck."""
    from zero_ckpt import dims, make_zero, weight_bytes

    size = parse_size(a.size)
    ck = make_zero(tmp / "run", size)
    step = ck / "global_step1"
    data = dir_bytes(step)
    vocab, hidden, inter, layers = dims(size)
    master = sum(f.stat().st_size for f in step.glob("*optim_states.pt"))
    script = str(ck / "zero_to_fp32.py")  # DeepSpeed copies it there; run as a user does
    notes = []
    contenders: dict[str, Callable[[Path], list[str]]] = {"cp -r + sync (global_step1)": cp_fsync(step)}
    hub = _hub_pythonpath()
    if hub is None:
        notes.append(f"zero_to_fp32.py not run: it needs huggingface_hub (install: `{HUB_INSTALL}`).")
    else:
        env = f"PYTHONPATH={shlex.quote(hub)} " if hub else ""

        def z2f(*flags: str) -> Callable[[Path], list[str]]:
            return lambda o: [
                "sh",
                "-c",
                f"{env}{shlex.join([PY, script, str(ck), str(o), *flags])} && sync {shlex.quote(str(o))}/*",
            ]

        contenders["zero_to_fp32.py (default)"] = z2f()
        contenders["zero_to_fp32.py --max_shard_size 200MB"] = z2f("--max_shard_size", "200MB")
    probe = subprocess.run(streamck("ls", str(ck)), capture_output=True, text=True)
    if probe.returncode == 0:
        contenders["streamck rewrite"] = lambda o: streamck("rewrite", str(ck), "-o", str(o), "-q")
    else:
        err = (probe.stderr.strip().splitlines() or ["(no message)"])[-1]
        notes.append(f"streamck not run: `streamck ls checkpoint-1` failed (status {probe.returncode}: {err}).")
    runs = contend(contenders, tmp / "out", a.reps, a.settle, (step,))
    return (
        f"Checkpoint: trained one AdamW step and saved by DeepSpeed {_ds_version()} (ZeRO-3, fp32, 2 CPU ranks "
        f"on gloo): `checkpoint-1/global_step1` {data / 2**30:.2f} GiB, of which optimizer states "
        f"{master / 2**30:.2f} GiB (fp32 master + 2 Adam moments); fp32 weights "
        f"{weight_bytes(size) / 2**30:.2f} GiB "
        f"(embedding {vocab}×{hidden} tied to lm_head, {layers} layers of H={hidden}, I={inter}). "
        f"{a.reps} interleaved reps, {a.settle:.0f} s settle; throughput is of the step directory.\n\n"
        + table(runs, "cp -r + sync (global_step1)", data)
        + "".join(f"\n\n{n}" for n in notes)
        + chart(a, runs, "zero", f"consolidating ZeRO-3 ({data / 2**30:.1f} GiB step dir): RSS over time")
    )


MEGATRON = os.environ.get("STREAMCK_MEGATRON_PATH", str(HERE.parent / ".venv" / "megatron-core-0.19.2"))


def _with_path(extra: str, cmd: list[str]) -> list[str]:
    """``cmd`` with ``extra`` put before PYTHONPATH (a trainer installed outside the venv)."""
    path = os.pathsep.join(p for p in (extra, os.environ.get("PYTHONPATH", "")) if p)
    return ["env", f"PYTHONPATH={path}", *cmd]


def _trainer_run(what: str, root: Path, params: int, extra: str = "") -> tuple:
    """A bench checkpoint written by the trainer's own code (bench/trainer_ckpt.py); its dims."""
    cmd = _with_path(extra, [PY, str(HERE / "trainer_ckpt.py"), what, str(root), str(params)])
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{what} checkpoint failed:\n{done.stderr[-4000:]}")
    return tuple(json.loads(done.stdout.strip().splitlines()[-1]))


def _params(size: str) -> int:
    return parse_size(size) // 4  # F32


@case(size="156MiB")
def case_titan(a: argparse.Namespace, tmp: Path) -> str:
    """torchtitan 0.3.0 step (FSDP2, 2 gloo ranks) -> Hugging Face: convert_to_hf.py's route vs --plan."""
    dims = _trainer_run("titan", tmp / "run", _params(a.size))
    step, config = tmp / "run" / "bench" / "checkpoint" / "step-1", tmp / "run" / "bench" / "config.json"
    data = dir_bytes(step)
    ckpt = str(HERE / "trainer_ckpt.py")
    contenders = {
        "cp -r + sync (step-1)": cp_fsync(step),
        "torchtitan convert_to_hf.py route": lambda o: [PY, ckpt, "convert_to_hf", str(step), json.dumps(dims), str(o)],
        "streamck --plan torchtitan-llama3": lambda o: streamck(
            "rewrite", str(step), "-o", str(o), "--plan", "torchtitan-llama3", "--hf-config", str(config), "-q"
        ),
    }
    runs = contend(contenders, tmp / "out", a.reps, a.settle, (step,))
    _, dim, nh, nkv, hd, hidden, layers, vocab, _ = dims
    model = 4 * (2 * vocab * dim + layers * (2 * dim * nh * hd + 2 * dim * nkv * hd + 3 * dim * hidden + 2 * dim) + dim)
    return (
        f"Checkpoint: a Llama 3 ({layers} layers, dim {dim}, {nh} heads / {nkv} KV heads, FFN {hidden}, vocab "
        f"{vocab}; F32 weights {model / 2**20:.0f} MiB) trained one AdamW step and saved by torchtitan 0.3.0's "
        f"CheckpointManager (FSDP2, 2 gloo ranks): `step-1` {data / 2**20:.0f} MiB with the optimizer state. "
        f"Output: the Hugging Face model (q/k rows RoPE-reordered). {a.reps} interleaved reps, {a.settle:.0f} s "
        "settle.\n\n" + table(runs, "cp -r + sync (step-1)", data)
    )


@case(size="156MiB")
def case_megatron(a: argparse.Namespace, tmp: Path) -> str:
    """Megatron-LM's training loop (pretrain, torch_dist, PP=2) -> HF: megatron-core's load + save vs --plan."""
    script, root = str(HERE / "megatron_train.py"), tmp / "run"
    ranks = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script]
    done = subprocess.run(_with_path(MEGATRON, [*ranks, "train", str(root), str(_params(a.size))]), capture_output=True,
                          text=True)  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"megatron training failed:\n{done.stderr[-4000:]}")
    dims = json.loads((root / "dims.json").read_text())
    run, step = root / "bench", root / "bench" / "iter_0000001"
    data = dir_bytes(step)
    contenders = {
        "cp -r + sync (iter_0000001)": cp_fsync(step),
        "load whole model, split, save (Bridge route)": lambda o: _with_path(
            MEGATRON, [PY, script, "load", str(root), json.dumps(dims), str(o)]
        ),
        "streamck --plan megatron-gpt": lambda o: streamck(
            "rewrite", str(run), "-o", str(o), "--plan", "megatron-gpt", "-q"
        ),
    }
    runs = contend(contenders, tmp / "out", a.reps, a.settle, (step,))
    layers, dim, nh, nkv, _, hidden, vocab, padded, *_ = dims
    return (
        f"Checkpoint: a Llama-style GPT ({layers} layers, hidden {dim}, {nh} heads / {nkv} query groups, FFN "
        f"{hidden}, vocab {vocab} padded to {padded}; F32) trained one Adam step by Megatron-LM's own `pretrain` "
        f"(megatron-core 0.19.2's `megatron.training`, `--ckpt-format torch_dist`, PP=2 on 2 gloo ranks): "
        f"`iter_0000001` {data / 2**20:.0f} MiB with the optimizer state. Output: the Hugging Face model (qkv split "
        f"per group, gate/up split, vocab trimmed; the config from the run's args). {a.reps} interleaved reps, "
        f"{a.settle:.0f} s settle.\n\n" + table(runs, "cp -r + sync (iter_0000001)", data)
    )


def _ds_version() -> str:
    proc = subprocess.run(
        [PY, "-c", "import importlib.metadata as m; print(m.version('deepspeed'))"], capture_output=True, text=True
    )
    return proc.stdout.strip() or "?"
