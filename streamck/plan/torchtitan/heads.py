"""What the torchtitan plans share: a tied head checked against the embedding, and the note
on what of a step is not written."""

from __future__ import annotations

from pathlib import Path

from streamck.errors import PlanError
from streamck.source import Checkpoint, TensorRef

# Bytes read at a time from each side when a tied head is compared with the embedding.
SAME_WINDOW = 8 << 20


def _same_head(head: TensorRef, embed: TensorRef, config_path: Path) -> None:
    """A config that ties the head, for a checkpoint whose head is not its embedding, is
    another model's: leaving the head out would change the model. Every byte is compared,
    in bounded windows (a head fine-tuned apart may differ in its last rows only)."""
    same = head.shape == embed.shape and head.dtype == embed.dtype and _same_bytes(head, embed)
    if not same:
        raise PlanError(
            f"tie_word_embeddings is true, but {head.name} is not {embed.name} in this checkpoint: "
            "the config is not this model's",
            config_path,
        )


def _same_bytes(a: TensorRef, b: TensorRef) -> bool:
    """Whether two tensors of one size hold the same bytes, read window by window (both in
    windows of one size, whatever their runs), stopping at the first difference."""
    from streamck.source.reader import Reader

    with Reader(SAME_WINDOW) as ra, Reader(SAME_WINDOW) as rb:
        return all(wa == wb for wa, wb in zip(ra.windows(a), rb.windows(b), strict=True))


def _left_out(ckpt: Checkpoint, model: dict, written: int, tied_head: bool) -> str:
    state = sorted({n.split(".")[0] for n in ckpt.tensors if n not in model})
    parts = [f"training state ({', '.join(state)})"] if state else []
    if tied_head:
        parts.append("lm_head.weight (tied: transformers ties it again on load)")
    return f"{written} model tensors to write; left out: " + ("; ".join(parts) or "nothing")
