"""verl 0.9.1 Megatron actor checkpoints, written by verl's own engine and checkpoint manager.

Each case runs tests/verl_mcore_child.py under ``torchrun`` on 2 CPU/gloo ranks in verl's own venv
(``.venv/verl-0.9.1``), with megatron-core 0.19.2 (``.venv/megatron-core-0.19.2``) and mbridge
0.15.1 (``.venv/mbridge-0.15.1``, verl's ``vanilla_mbridge`` bridge; scripts/test installs both
as folders put on the child's path): a tiny HF model (tests/verl_child.py ``make_base``: Qwen2
with a tied head, or Llama untied) built into a megatron-core GPTModel by verl's
``MegatronEngineWithLMHead``, bf16 params, TP or PP = 2, trained one step and saved by
``MegatronCheckpointManager`` with ``use_dist_checkpointing`` (or, ``tp2_default``, verl's
defaults: the model only as the bridge's HF weights) into ``run/global_step_1/actor/``
(see verl_mcore_child.py for the CPU patches). Beside each run: ``oracle.pt`` (token ids and the
logits of Megatron's own forward) and, where the actor holds its HF config, ``merged/``: verl's
own merger (``python -m verl.model_merger merge --backend megatron``) run on CPU.
Built once into ``root/verl-megatron-<versions>-v<FIXTURE_VERSION>``.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from helpers import built_once
from trainer_fixtures import _free_port

FIXTURE_VERSION = 2
ROOT = Path(__file__).resolve().parent.parent
VERL_PYTHON = ROOT / ".venv" / "verl-0.9.1" / "bin" / "python"
PATHS = [ROOT / ".venv" / "megatron-core-0.19.2", ROOT / ".venv" / "mbridge-0.15.1"]
BASE = Path(__file__).with_name("verl_child.py")
CHILD = Path(__file__).with_name("verl_mcore_child.py")
WITH_HF = "model,optimizer,extra,hf_model"

# name, architecture, TP, PP, save_contents, the model as a dist checkpoint (use_dist_checkpointing)
CASES = [
    ("tp2_tied", "qwen2", 2, 1, WITH_HF, True),
    ("pp2_untied", "llama", 1, 2, WITH_HF, True),
    ("tp2_no_hf", "qwen2", 2, 1, "model,optimizer,extra", True),  # verl's default contents: no huggingface/
    ("tp2_default", "qwen2", 2, 1, "model,optimizer,extra", False),  # verl's defaults: the bridge's HF weights
]
KEYS = ("name", "arch", "tp", "pp", "contents", "dist")


def cases() -> list[dict]:
    return [dict(zip(KEYS, c, strict=True)) for c in CASES]


def _run(cmd: list, timeout: int, what: str, paths: bool = True) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(map(str, PATHS)) if paths else ""
    done = subprocess.run(["timeout", str(timeout), *map(str, cmd)], env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{what} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")


def _build_case(case: dict, out: Path) -> None:
    out.mkdir()
    _run([VERL_PYTHON, BASE, "base", out, case["arch"]], 300, f"{case['name']}: base model", paths=False)
    torchrun = [VERL_PYTHON, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}"]
    args = [CHILD, out, case["tp"], case["pp"], case["contents"], "dist" if case["dist"] else "hf"]
    _run([*torchrun, *args], 900, f"{case['name']}: verl run")
    if "hf_model" in case["contents"] and case["dist"]:
        actor = out / "run" / "global_step_1" / "actor"
        tied = ["--tie-word-embedding"] if case["arch"] == "qwen2" else []
        merge = [VERL_PYTHON, CHILD, "merge", "merge", "--backend", "megatron", *tied]
        _run([*merge, "--local_dir", actor, "--target_dir", out / "merged"], 600, f"{case['name']}: verl's merger")


def _versions() -> str:
    import torch

    return f"verl-0.9.1-mcore-0.19.2-mbridge-0.15.1-torch-{torch.__version__.split('+')[0]}"


def make_verl_megatron_checkpoints(root: Path) -> dict[str, dict]:
    """Build (once) and list the cases under ``root`` by name; each dict has the case's fields
    and paths ``dir``, ``base`` (the HF model the run started from), ``run``, ``step``,
    ``actor``, ``merged`` (None without ``hf_model``), ``oracle``."""
    missing = [p for p in (VERL_PYTHON, *PATHS) if not p.exists()]
    if missing:
        raise RuntimeError(f"no {missing[0]}: run scripts/test, which makes it")
    base = Path(root) / f"verl-megatron-{_versions()}-v{FIXTURE_VERSION}"

    def build(tmp: Path) -> None:
        for c in cases():
            _build_case(c, tmp / c["name"])
        (tmp / "cases.json").write_text(json.dumps(cases(), indent=1))

    built_once(base, build)
    out = {}
    for c in json.loads((base / "cases.json").read_text()):
        d = base / c["name"]
        step = d / "run" / "global_step_1"
        merged = d / "merged"
        out[c["name"]] = {**c, "dir": d, "base": d / "base", "run": d / "run", "step": step, "actor": step / "actor",
                          "merged": merged if merged.is_dir() else None, "oracle": d / "oracle.pt"}  # fmt: skip
    return out
