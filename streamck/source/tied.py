"""Tied output heads as ``save_pretrained`` writes them: a ZeRO or FSDP state holds the head
under its own name too; the config decides whether it is left out (``--keep-tied`` keeps it)."""

from __future__ import annotations

from pathlib import Path

from streamck.errors import listing
from streamck.source.crosscheck import side_object
from streamck.source.index import Checkpoint

# The output embeddings transformers ties to the input embeddings on load when the config
# says ``tie_word_embeddings``; ``save_pretrained`` leaves them out. Other ties are kept.
OUTPUT_HEADS = ("lm_head.weight", "embed_out.weight")
# The input embeddings an output head may be tied to (``tie_word_embeddings``), by head.
TIED_TO = {
    "lm_head.weight": ("model.embed_tokens.weight", "transformer.wte.weight", "model.decoder.embed_tokens.weight"),
    "embed_out.weight": ("gpt_neox.embed_in.weight",),
}


def untie(ckpt: Checkpoint, aliases: dict[str, str], keep_tied: bool = False) -> Checkpoint:
    """Leave out a ZeRO checkpoint's tied output head (``lm_head.weight``, an alias of
    ``model.embed_tokens.weight``) when its ``config.json`` says ``tie_word_embeddings``,
    as ``save_pretrained`` leaves it out (transformers ties it again on load)."""
    heads = {a: t for a, t in aliases.items() if a.endswith(OUTPUT_HEADS)}
    if keep_tied or not heads or not ties_embeddings(ckpt.side_root or ckpt.root):
        return ckpt
    for alias in heads:
        del ckpt.tensors[alias]
    pairs = listing([f"{a} (= {t})" for a, t in heads.items()], 3)
    ckpt.notices.append(
        f"tied {pairs} left out, as save_pretrained writes it (tie_word_embeddings in config.json); "
        "--keep-tied writes every name"
    )
    return ckpt


def ties_embeddings(root: Path) -> bool:
    """Whether ``root/config.json`` says ``tie_word_embeddings: true`` (at the top or in
    ``text_config``); False when there is no config."""
    config = side_object(root / "config.json", "is not a JSON object") or {}
    text = config.get("text_config")
    return config.get("tie_word_embeddings") is True or (
        isinstance(text, dict) and text.get("tie_word_embeddings") is True
    )


def untie_fsdp(ckpt: Checkpoint, keep_tied: bool) -> Checkpoint:
    """An FSDP model (tied heads under both names, config.json maybe missing) as save_pretrained writes it."""
    ckpt.notices.extend(no_config(ckpt.side_root or ckpt.root))
    return untie(ckpt, head_aliases(ckpt.tensors), keep_tied)


def tied_kept(ckpt: Checkpoint, keep_tied: bool) -> Checkpoint:
    """A source read as saved: --keep-tied has nothing to keep, and the user hears so."""
    if keep_tied:
        ckpt.notices.append(
            "--keep-tied does nothing here: only ZeRO and FSDP state leave tied heads out; read as saved"
        )
    return ckpt


def head_aliases(tensors: dict) -> dict[str, str]:
    """Each output head (TIED_TO) with the input embedding of its dtype and shape it may be
    tied to: an FSDP state dict holds a tied head under both names and records no aliases,
    so the config decides (untie)."""
    found = {}
    for head, inputs in TIED_TO.items():
        ref = tensors.get(head)
        same = [n for n in inputs if ref and n in tensors and tensors[n][1:3] == ref[1:3]]  # (dtype, shape)
        if same:
            found[head] = same[0]
    return found


def no_config(side: Path) -> list[str]:
    """A notice when ``side`` holds no config.json, as Trainer leaves SHARDED_STATE_DICT checkpoints."""
    if (side / "config.json").is_file():
        return []
    return [
        f"no config.json in {side.name}: copy the model's config.json and tokenizer into the output "
        "for from_pretrained (Trainer saves none with SHARDED_STATE_DICT)"
    ]
