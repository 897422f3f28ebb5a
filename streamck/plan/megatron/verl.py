"""verl's Megatron actor checkpoints (``MegatronCheckpointManager``, verl 0.9.1), found for
``--plan megatron-gpt``.

verl saves the actor's GPTModel with megatron-core's ``dist_checkpointing`` (``torch_dist``, its
``sharded_state_dict`` keys with no prefix and no Megatron ``args``) when
``use_dist_checkpointing`` is on. Layout v2 (verl 0.9): ``actor/model/dist_ckpt/``, the HF config
and tokenizer (and the bridge's HF weights) in ``actor/model/huggingface/`` when ``hf_model`` is
among ``save_contents``, ``actor/optimizer/dist_ckpt/`` (optimizer, LR scheduler),
``actor/extra/dist_ckpt/`` (RNG), ``transformer_config.json``, ``ckpt_contents.json``. Layout v1
(earlier verl): ``actor/dist_ckpt/`` and ``actor/huggingface/``. The trainer writes
``global_step_N/data.pt`` beside the actor and ``latest_checkpointed_iteration.txt`` in the run root.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from streamck.errors import listing
from streamck.plan.megatron.layout import TRACKER

# (the model's dist checkpoint, the HF folder), relative to the actor folder, v2 first.
LAYOUTS = (("model/dist_ckpt", "model/huggingface"), ("dist_ckpt", "huggingface"))
# What the actor and its step hold beside the model, never read, with what each is.
LEFT_OUT = (
    ("optimizer/dist_ckpt", "optimizer and LR scheduler state"),
    ("extra/dist_ckpt", "RNG state"),
)


class VerlActor(NamedTuple):
    """A verl Megatron actor: its folder, the model's dist checkpoint, its HF folder."""

    actor: Path
    dist: Path
    hf: Path


def _actor(path: Path) -> VerlActor | None:
    for dist, hf in LAYOUTS:
        if (path / dist / "metadata.json").is_file():
            return VerlActor(path, path / dist, path / hf)
    return None


def find_actor(path: Path) -> VerlActor | None:
    """The verl Megatron actor that ``path`` names: the actor folder, its ``global_step_N/``, or
    a run root whose tracker names such a step; None when ``path`` is none of these."""
    if (path / TRACKER).is_file():
        text = (path / TRACKER).read_text().strip()
        if text.isdigit() and (path / f"global_step_{text}").is_dir():
            path = path / f"global_step_{text}"
    return _actor(path) or _actor(path / "actor")


def verl_config(found: VerlActor, given: str | None) -> str | None:
    """``--hf-config`` when given, else the actor's ``huggingface/config.json`` (None when verl
    saved none: without ``hf_model`` in ``save_contents`` it writes no HF folder)."""
    if given is not None:
        return given
    config = found.hf / "config.json"
    return str(config) if config.is_file() else None


def tokenizer_files(found: VerlActor) -> dict[str, Path]:
    """What a directory output copies from the actor's HF folder beside the plan's own
    ``config.json``: tokenizer and generation config (never the bridge's weights)."""
    from streamck.source.layout import side_files

    if not found.hf.is_dir():
        return {}
    return {n: p for n, p in side_files(found.hf).items() if n != "config.json"}


def left_out(found: VerlActor) -> str:
    """One note naming what is not read beside the model's dist checkpoint."""
    out = [f"{rel}/ ({what})" for rel, what in LEFT_OUT if (found.actor / rel).is_dir()]
    if any(found.hf.glob("*.safetensors")):
        out.append(f"{found.hf.relative_to(found.actor)}/ weights (hf_model, the bridge's export)")
    step = found.actor.parent
    if found.actor.name == "actor":
        out += ["../data.pt (dataloader state)"] if (step / "data.pt").is_file() else []
        out += [f"../{p.name}/ (another role)" for p in sorted(step.iterdir()) if p.is_dir() and p != found.actor]
    return f"verl Megatron actor: read {found.dist.relative_to(found.actor)}/" + (
        f"; left out: {listing(out, 6)}" if out else ""
    )
