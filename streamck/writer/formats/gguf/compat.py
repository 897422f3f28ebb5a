"""Where the gguf-py on PyPI (0.19.0, the newest there) reads a model's folder otherwise than the
gguf-py that llama-cpp-python 0.3.36 vendors beside ``convert_hf_to_gguf.py`` (its version string
is also 0.19.0, its code later). Only the differences that change a dense BPE model's keys are
made up here; each names the vendored behaviour it restores. Drop a rule once a gguf release on
PyPI has it (the GGUF tests compare every key with the vendored converter's).

Beside those, speed-ups that change nothing: ``tokenizer.json`` parsed once per conversion
(tokenizer_json) and its merges read in one pass (merges), where gguf-py's ``SpecialVocab``
rebuilds each merge a character at a time; the cycle collector paused while the vocabulary is
read (paused_gc).
"""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import gguf
import orjson

_PARSED: dict[tuple[str, int, int], Any] = {}  # tokenizer_json's one file: (path, mtime, size) -> parse


def tokenizer_json(path: Path) -> Any:
    """``path`` (a ``tokenizer.json``) parsed by orjson, by ``json`` where orjson refuses it (NaN,
    lone surrogates, 1e400); the fields read from it (strings, flags, small ids) parse alike in
    both (orjson differs on integers past 64 bits: floats). The last file parsed is kept until
    forget() (the plan pass and the header read it), a changed file parsed again."""
    stat = path.stat()
    key = (str(path), stat.st_mtime_ns, stat.st_size)
    data = _PARSED.get(key)
    if data is None:
        raw = path.read_bytes()
        with paused_gc():
            try:
                data = orjson.loads(raw)
            except orjson.JSONDecodeError:  # what orjson refuses and json reads (NaN, lone surrogates)
                data = json.loads(raw)
        _PARSED.clear()  # one file kept (another thread's forget() in between costs a parse, no more)
        _PARSED[key] = data
    return data


@contextmanager
def paused_gc() -> Iterator[None]:
    """Python's cycle collector paused inside, as it was after. A vocabulary is ~10^6 new lists,
    dicts and strings: each burst of them sets off collections that walk every container alive,
    half a parse's time; none of them is in a cycle."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def forget() -> None:
    """Drop tokenizer_json's kept parse (the header is written)."""
    _PARSED.clear()


def merges(data: Any) -> list[str] | None:
    """gguf-py's ``SpecialVocab`` merges for ``tokenizer.json``'s ``model.merges`` in the pair
    format (``[["a", "b"], ...]``, transformers >= 4.45): ``"a b"``, a space inside a part
    written as U+0120 (with gguf-py's warning), the same strings; None for the other formats or
    none, which gguf-py reads itself."""
    pairs = data.get("model", {}).get("merges") if isinstance(data, dict) else None
    if not (isinstance(pairs, list) and pairs and isinstance(pairs[0], list) and len(pairs[0]) == 2):
        return None
    if not isinstance(pairs[0][0], str):
        return None
    spaced = []
    try:
        out = [a + " " + b if " " not in a and " " not in b else _escaped(a, b, spaced) for a, b in pairs]
    except (TypeError, ValueError):  # not pairs of strings: gguf-py's to read (and refuse)
        return None
    if spaced:
        gguf.vocab.logger.warning(f"Spaces in merges detected, encoding as {chr(ord(' ') + 256)!r}")
    return out


def _escaped(a: str, b: str, seen: list[str]) -> str:
    """A merge whose parts hold spaces, each written as U+0120 (``chr(ord(" ") + 256)``); ``a``
    noted in ``seen``."""
    seen.append(a)
    return a.replace(" ", "\u0120") + " " + b.replace(" ", "\u0120")


class SpecialVocab(gguf.SpecialVocab):
    """gguf-py's SpecialVocab, plus the vendored rule that a ``ByteLevel`` post-processor (alone,
    or in a ``Sequence`` before a template) means no BOS and no EOS are added unless a later
    processor or ``tokenizer_config.json`` says so: the vendored one writes
    ``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` false for Qwen and ``add_eos_token``
    false for Llama 3; PyPI's writes neither. Its merges are merges()'s where that reads them."""

    def _try_load_from_tokenizer_json(self, path: Path) -> bool:
        tokenizer_file = path / "tokenizer.json"
        data = tokenizer_json(tokenizer_file) if tokenizer_file.is_file() else {}
        post = data.get("post_processor") if isinstance(data, dict) else None
        kinds = [p.get("type") for p in (post or {}).get("processors", [post or {}])]
        if kinds[:1] == ["ByteLevel"]:  # before the others, as the vendored loop meets it: the keys' order is its
            self._no_bos_eos()
        wanted = self.load_merges
        if wanted and (found := merges(data)) is not None:
            self.merges, self.load_merges = found, False  # read: gguf-py's pass below skips them
        del data, post
        forget()  # the vocabulary's last reader: the parse is freed before gguf-py parses the file again
        try:
            found = super()._try_load_from_tokenizer_json(path)
        finally:
            self.load_merges = wanted
        if "ByteLevel" in kinds[1:]:
            self._no_bos_eos()
        return found

    def _no_bos_eos(self) -> None:
        self.add_special_token.setdefault("bos", False)
        self.add_special_token.setdefault("eos", False)


def load_metadata(model_dir: Path, total_params: int) -> gguf.Metadata:
    """``gguf.Metadata.load`` for the model's folder (no override file, no name given), plus the
    vendored rule that ``generation_config.json``'s ``repetition_penalty`` stands in for a
    missing ``penalty_repeat`` (``general.sampling.penalty_repeat``)."""
    metadata = gguf.Metadata.load(None, model_dir, None, total_params)
    gen = gguf.Metadata.load_generation_config(model_dir)
    if gen and "penalty_repeat" not in gen and "repetition_penalty" in gen:
        metadata.sampling_penalty_repeat = gen["repetition_penalty"]
    return metadata
