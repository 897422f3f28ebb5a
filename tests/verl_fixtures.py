"""verl 0.9.1 FSDP actor checkpoints, written by verl's own engine and checkpoint manager.

Each case runs tests/verl_child.py under ``torchrun`` on CPU/gloo in verl's own venv
(``.venv/verl-0.9.1``, made by scripts/test: verl pins transformers < 5.11): a tiny model
(Qwen2 with a tied head, or Llama untied; 2 layers, hidden 64, vocab 320) trained one step by
``FSDPEngineWithLMHead`` under FSDP1 or FSDP2 and saved by ``FSDPCheckpointManager`` into
``run/global_step_1/actor/`` (see verl_child.py for the CPU patches). Beside each run:
``live.pt`` (the trained model's full state dict, torch's own gather) and, but for LoRA,
``merged/``, verl's own merger (``python -m verl.model_merger merge --backend fsdp``).
Built once into ``root/verl-<versions>-v<FIXTURE_VERSION>``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from helpers import built_once
from trainer_fixtures import _free_port

FIXTURE_VERSION = 1
ROOT = Path(__file__).resolve().parent.parent
VERL_PYTHON = ROOT / ".venv" / "verl-0.9.1" / "bin" / "python"
CHILD = Path(__file__).with_name("verl_child.py")

# name, architecture, verl strategy, ranks, fsdp_size (-1: all ranks; else HSDP), LoRA rank
CASES = [
    ("fsdp2_tied_w3", "qwen2", "fsdp2", 3, -1, 0),  # 320 rows: 107/107/106, the last storage padded
    ("fsdp1_untied_w2", "llama", "fsdp", 2, -1, 0),
    ("fsdp1_tied_w2", "qwen2", "fsdp", 2, -1, 0),
    ("fsdp2_untied_hsdp_w4", "llama", "fsdp2", 4, 2, 0),  # ("ddp", "fsdp") mesh 2 x 2
    ("fsdp2_lora_w2", "qwen2", "fsdp2", 2, -1, 4),
]
KEYS = ("name", "arch", "strategy", "world", "fsdp_size", "lora")


def cases() -> list[dict]:
    return [dict(zip(KEYS, c, strict=True)) for c in CASES]


# What the fixtures' contents follow (fixture_cache's key, with the installed packages).
CODE = ("tests/verl_fixtures.py", "tests/verl_child.py")


def run(cmd: list, timeout: int, what: str, paths: tuple = ()) -> None:
    """``cmd`` under ``timeout`` seconds with ``paths`` (only) on its PYTHONPATH; its output in the error."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(map(str, paths))
    done = subprocess.run(["timeout", str(timeout), *map(str, cmd)], env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{what} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")


def make_runs(base: Path, cases: list[dict], build_case: Callable[[dict, Path], None]) -> dict[str, dict]:
    """Build (once, into ``base``) and list verl runs by case name: each case's folder starts with
    ``base/``, the tiny HF model of its ``arch`` (verl_child.py ``base``, deterministic: made once per
    architecture and copied), then ``build_case(case, folder)`` runs verl. Each dict has the case's
    fields and paths ``dir``, ``base``, ``run``, ``step``, ``actor``, ``merged`` (None where verl's merger
    did not run) and, where the run wrote them, ``live`` (live.pt) and ``oracle`` (oracle.pt)."""

    def build(tmp: Path) -> None:
        models = tmp / ".bases"
        for arch in sorted({c["arch"] for c in cases}):
            run([VERL_PYTHON, CHILD, "base", models / arch, arch], 300, f"{arch}: base model")
        for c in cases:
            (tmp / c["name"]).mkdir()
            shutil.copytree(models / c["arch"] / "base", tmp / c["name"] / "base")
            build_case(c, tmp / c["name"])
        shutil.rmtree(models)
        (tmp / "cases.json").write_text(json.dumps(cases, indent=1))

    built_once(base, build)
    out = {}
    for c in json.loads((base / "cases.json").read_text()):
        d = base / c["name"]
        step, merged = d / "run" / "global_step_1", d / "merged"
        files = {f.stem: f for f in (d / "live.pt", d / "oracle.pt") if f.exists()}
        out[c["name"]] = {**c, "dir": d, "base": d / "base", "run": d / "run", "step": step, "actor": step / "actor",
                          "merged": merged if merged.is_dir() else None, **files}  # fmt: skip
    return out


def _build_case(case: dict, out: Path) -> None:
    torchrun = [VERL_PYTHON, "-m", "torch.distributed.run", f"--nproc_per_node={case['world']}"]
    args = [CHILD, out, case["strategy"], case["fsdp_size"], case["lora"]]
    run([*torchrun, f"--master_port={_free_port()}", *args], 900, f"{case['name']}: verl run")
    if not case["lora"]:
        actor = out / "run" / "global_step_1" / "actor"
        merge = [VERL_PYTHON, "-m", "verl.model_merger", "merge", "--backend", "fsdp"]
        run([*merge, "--local_dir", actor, "--target_dir", out / "merged"], 600, f"{case['name']}: verl's merger")


def _versions() -> str:
    import torch

    return f"verl-0.9.1-torch-{torch.__version__.split('+')[0]}"


def make_verl_checkpoints(root: Path) -> dict[str, dict]:
    """Build (once) and list the cases under ``root`` by name (make_runs; ``live`` in each)."""
    if not VERL_PYTHON.exists():
        raise RuntimeError(f"no verl venv at {VERL_PYTHON}: run scripts/test, which makes it")
    return make_runs(Path(root) / f"verl-{_versions()}-v{FIXTURE_VERSION}", cases(), _build_case)
