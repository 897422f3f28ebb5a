"""verl's Megatron actor checkpoints (``MegatronCheckpointManager``, verl 0.9.1) for
``--plan megatron-gpt``: the actor's model dist checkpoint, its HF config and tokenizer.

verl saves the actor's GPTModel with megatron-core's ``dist_checkpointing`` (``torch_dist``: the
model's ``sharded_state_dict`` keys with no prefix, and no Megatron ``args``) when
``use_dist_checkpointing`` is on, into ``model/dist_ckpt/`` (the layout:
streamck.source.verl.megatron). The config is ``model/huggingface/config.json``, written only with
``hf_model`` in ``save_contents``.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import orjson

from streamck.errors import PlanError
from streamck.plan.megatron.layout import TRACKER
from streamck.source.verl.megatron import DIST, HF, MANIFEST, actor_of, left_beside


class VerlActor(NamedTuple):
    """A verl Megatron actor: its folder, the model's dist checkpoint, its HF folder."""

    actor: Path
    dist: Path
    hf: Path


def find_actor(path: Path) -> VerlActor | None:
    """The verl Megatron actor that ``path`` names: the actor folder, its ``global_step_N/``, or
    a run root whose tracker names such a step; None when ``path`` is none of these. An actor
    with no model dist checkpoint (verl's default: the model is the bridge's HF weights) and a
    LoRA actor (its manifest says ``peft``: the dist checkpoint holds the adapter alone) are refused."""
    if (path / TRACKER).is_file():
        try:
            text = (path / TRACKER).read_text().strip()
        except (OSError, UnicodeDecodeError):
            text = ""  # not a tracker verl wrote: read the folder as it is
        if text.isdigit() and (path / f"global_step_{text}").is_dir():
            path = path / f"global_step_{text}"
    actor = actor_of(path)
    found = VerlActor(actor, actor / DIST, actor / HF) if actor and (actor / DIST / "metadata.json").is_file() else None
    if found is None and actor is not None:
        raise PlanError("a verl Megatron actor saved without use_dist_checkpointing: its model is the bridge's "
                        "Hugging Face weights in huggingface/, which streamck reads without {plan}", actor)  # fmt: skip
    if found is not None and _peft(found.actor / MANIFEST):
        raise PlanError(f"a verl Megatron LoRA actor ({MANIFEST}: peft): its dist checkpoint holds the adapter "
                        "alone, not the model; the base is the bridge's huggingface/ folder", found.actor)  # fmt: skip
    return found


def _peft(manifest: Path) -> bool:
    try:
        backend = orjson.loads(manifest.read_bytes()).get("backend")
    except (OSError, orjson.JSONDecodeError, AttributeError):
        return False
    return isinstance(backend, dict) and backend.get("peft") is True


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
    """One note naming what is read and what is not beside the model's dist checkpoint."""
    note = left_beside(found.actor, f"{found.dist.relative_to(found.actor)}/")
    if any(found.hf.glob("*.safetensors")):
        weights = f"{found.hf.relative_to(found.actor)}/ weights (hf_model, the bridge's export)"
        note += f", {weights}" if "; left out: " in note else f"; left out: {weights}"
    return note
