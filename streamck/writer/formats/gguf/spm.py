"""A SentencePiece vocabulary (``tokenizer.model``: Llama 2, Mistral) as ``convert_hf_to_gguf.py``
writes it (``TextModel._create_vocab_sentencepiece``): every id's piece, score and type from the
``sentencepiece`` library, then the ids ``added_tokens.json`` and ``tokenizer_config.json``'s
``added_tokens_decoder`` name, then ``[PADi]`` up to the config's ``vocab_size``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf

from streamck.errors import PlanError
from streamck.writer.formats.gguf.table import looks_special

UNUSED_SCORE, ADDED_SCORE = -10000.0, -1000.0


def pieces(model_dir: Path, hparams: dict[str, Any]) -> tuple[list[bytes], list[float], list[int]]:
    """Every id's token (bytes), score and ``gguf.TokenType``, as the reference lists them."""
    try:
        from sentencepiece import SentencePieceProcessor
    except ImportError:
        raise PlanError(
            "a SentencePiece tokenizer (tokenizer.model) needs sentencepiece: pip install sentencepiece"
        ) from None
    sp = SentencePieceProcessor()
    sp.LoadFromFile(str(model_dir / "tokenizer.model"))
    size = hparams.get("vocab_size_per_layer_input") or hparams.get("vocab_size") or sp.vocab_size()
    tokens = [f"[PAD{i}]".encode() for i in range(size)]
    scores, types = [UNUSED_SCORE] * size, [int(gguf.TokenType.UNUSED)] * size
    for i in range(min(size, sp.vocab_size())):
        tokens[i], scores[i], types[i] = sp.IdToPiece(i).encode(), sp.GetScore(i), _kind(sp, i)
    _added_json(model_dir / "added_tokens.json", tokens, scores, types)
    _added_decoder(model_dir / "tokenizer_config.json", tokens, scores, types)
    return tokens, scores, types


def _kind(sp, i: int) -> int:
    """The piece's type, in the reference's order of questions."""
    checks = ((sp.IsUnknown, gguf.TokenType.UNKNOWN), (sp.IsControl, gguf.TokenType.CONTROL),
              (sp.IsUnused, gguf.TokenType.UNUSED), (sp.IsByte, gguf.TokenType.BYTE))  # fmt: skip
    return int(next((kind for check, kind in checks if check(i)), gguf.TokenType.NORMAL))


def _added_json(path: Path, tokens: list[bytes], scores: list[float], types: list[int]) -> None:
    """``added_tokens.json``'s tokens (content -> id) as user-defined, ids past the vocabulary ignored."""
    if not path.is_file():
        return
    for content, i in json.loads(path.read_bytes()).items():
        if i < len(tokens):
            tokens[i], scores[i], types[i] = content.encode(), ADDED_SCORE, int(gguf.TokenType.USER_DEFINED)


def _added_decoder(path: Path, tokens: list[bytes], scores: list[float], types: list[int]) -> None:
    """``added_tokens_decoder``'s tokens: control where special or looking special, else
    user-defined with SentencePiece's ``▁`` as a space."""
    if not path.is_file():
        return
    for key, data in json.loads(path.read_bytes()).get("added_tokens_decoder", {}).items():
        i, content = int(key), data["content"]
        if i >= len(tokens):
            continue
        if data.get("special") or looks_special(content):
            types[i] = int(gguf.TokenType.CONTROL)
        else:
            content = content.replace("\u2581", " ")
            types[i] = int(gguf.TokenType.USER_DEFINED)
        tokens[i], scores[i] = content.encode(), ADDED_SCORE
