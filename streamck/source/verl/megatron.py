"""verl's Megatron actor checkpoints (``MegatronCheckpointManager``, verl 0.9.1): where the model is.

Layout v2 (verl 0.9): ``actor/ckpt_contents.json`` (the manifest: ``contents.model`` says where the
model went), ``actor/model/dist_ckpt/`` (megatron-core ``torch_dist``, with
``use_dist_checkpointing``), ``actor/model/huggingface/`` (config and tokenizer; the bridge's HF
weights: the model itself without ``use_dist_checkpointing``, verl's default, or beside the
dist checkpoint with ``hf_model`` in ``save_contents``), ``actor/optimizer/dist_ckpt/``,
``actor/extra/dist_ckpt/`` (RNG), ``transformer_config.json``. Layout v1 (earlier verl:
``actor/dist_ckpt/`` with everything, ``actor/huggingface/``) is refused. The trainer writes ``global_step_N/data.pt``
beside the actor. The dist checkpoint is read by ``--plan megatron-gpt``
(streamck.plan.megatron.verl); without a plan, the bridge's HF weights are read.
"""

from __future__ import annotations

from pathlib import Path

from streamck.errors import CheckpointError, listing

MANIFEST = "ckpt_contents.json"
# The model's dist checkpoint and the HF folder, relative to the actor folder (layout v2).
DIST, HF = "model/dist_ckpt", "model/huggingface"
LEGACY = "dist_ckpt"  # layout v1's one dist checkpoint: model, optimizer and RNG state together
# What the actor holds beside the model, never read, with what each is.
LEFT_OUT = (
    ("optimizer/dist_ckpt", "optimizer and LR scheduler state"),
    ("extra/dist_ckpt", "RNG state"),
)


def is_actor(path: Path) -> bool:
    """Whether ``path`` is a verl Megatron actor folder (its manifest, or a dist checkpoint of
    either layout)."""
    return (path / MANIFEST).is_file() or any((path / d / "metadata.json").is_file() for d in (DIST, LEGACY))


def actor_of(path: Path) -> Path | None:
    """The verl Megatron actor folder ``path`` or its ``global_step_N/`` names, or None. Layout
    v1 is refused in one line: verl 0.9.1 refuses it too, naming its migration script, and no
    checkpoint of it could be produced here to check a reading against."""
    actor = next((d for d in (path, path / "actor") if is_actor(d)), None)
    if actor is not None and (actor / LEGACY / "metadata.json").is_file() and not (actor / "model").is_dir():
        raise CheckpointError(f"verl's pre-0.9 Megatron layout ({LEGACY}/ holding model, optimizer and RNG state): "
                              "not read; verl 0.9's scripts/migrate_megatron_checkpoint_layout.py moves it to "
                              "model/, optimizer/, extra/", actor)  # fmt: skip
    return actor


def hf_weights(path: Path) -> tuple[Path, Path] | None:
    """(the actor, its HF folder) when ``path`` (the actor or its ``global_step_N/``) is a verl
    Megatron actor whose model is the bridge's HF weights; a one-line error when its model is a
    dist checkpoint (``--plan megatron-gpt`` reads it); None when ``path`` is no such actor."""
    actor = actor_of(path)
    if actor is None:
        return None
    if (actor / DIST / "metadata.json").is_file():
        raise CheckpointError(f"a verl Megatron actor: its model is megatron-core's torch_dist checkpoint in "
                              f"{DIST}/: give {{plan}} megatron-gpt", actor)  # fmt: skip
    return (actor, actor / HF) if any((actor / HF).glob("*.safetensors")) else None


def left_beside(actor: Path, read: str) -> str:
    """One note: what of the actor was read (``read``) and what is not, beside it and its step."""
    out = [f"{rel}/ ({what})" for rel, what in LEFT_OUT if (actor / rel).is_dir()]
    step = actor.parent
    if actor.name == "actor":
        out += ["../data.pt (dataloader state)"] if (step / "data.pt").is_file() else []
        out += [f"../{p.name}/ (another role)" for p in sorted(step.iterdir()) if p.is_dir() and p != actor]
    return f"verl Megatron actor: read {read}" + (f"; left out: {listing(out, 6)}" if out else "")
