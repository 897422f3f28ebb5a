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

from pathlib import Path

import verl_fixtures
from trainer_fixtures import _free_port
from verl_fixtures import VERL_PYTHON, make_runs, run

FIXTURE_VERSION = 2
ROOT = Path(__file__).resolve().parent.parent
PATHS = (ROOT / ".venv" / "megatron-core-0.19.2", ROOT / ".venv" / "mbridge-0.15.1")
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


# What the fixtures' contents follow (fixture_cache's key, with the installed packages).
CODE = ("tests/verl_megatron_fixtures.py", "tests/verl_mcore_child.py", *verl_fixtures.CODE)
CODE += ("bench/megatron_ckpt.py", "bench/standins.py")  # verl_mcore_child.py's stand-ins


def _build_case(case: dict, out: Path) -> None:
    torchrun = [VERL_PYTHON, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}"]
    args = [CHILD, out, case["tp"], case["pp"], case["contents"], "dist" if case["dist"] else "hf"]
    run([*torchrun, *args], 900, f"{case['name']}: verl run", PATHS)
    if "hf_model" in case["contents"] and case["dist"]:
        actor = out / "run" / "global_step_1" / "actor"
        tied = ["--tie-word-embedding"] if case["arch"] == "qwen2" else []
        merge = [VERL_PYTHON, CHILD, "merge", "merge", "--backend", "megatron", *tied]
        what = f"{case['name']}: verl's merger"
        run([*merge, "--local_dir", actor, "--target_dir", out / "merged"], 600, what, PATHS)


def _versions() -> str:
    import torch

    return f"verl-0.9.1-mcore-0.19.2-mbridge-0.15.1-torch-{torch.__version__.split('+')[0]}"


def make_verl_megatron_checkpoints(root: Path) -> dict[str, dict]:
    """Build (once) and list the cases under ``root`` by name (verl_fixtures.make_runs; ``oracle`` in each)."""
    missing = [p for p in (VERL_PYTHON, *PATHS) if not p.exists()]
    if missing:
        raise RuntimeError(f"no {missing[0]}: run scripts/test, which makes it")
    return make_runs(Path(root) / f"verl-megatron-{_versions()}-v{FIXTURE_VERSION}", cases(), _build_case)
