"""Where the gguf-py on PyPI (0.19.0, the newest there) reads a model's folder otherwise than the
gguf-py that llama-cpp-python 0.3.36 vendors beside ``convert_hf_to_gguf.py`` (its version string
is also 0.19.0, its code later). Only the differences that change a dense BPE model's keys are
made up here; each names the vendored behaviour it restores. Drop a rule once a gguf release on
PyPI has it (the GGUF tests compare every key with the vendored converter's).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf


class SpecialVocab(gguf.SpecialVocab):
    """gguf-py's SpecialVocab, plus the vendored rule that a ``ByteLevel`` post-processor (alone,
    or in a ``Sequence`` before a template) means no BOS and no EOS are added unless a later
    processor or ``tokenizer_config.json`` says so: the vendored one writes
    ``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` false for Qwen and ``add_eos_token``
    false for Llama 3; PyPI's writes neither."""

    def _try_load_from_tokenizer_json(self, path: Path) -> bool:
        tokenizer_file = path / "tokenizer.json"
        post = json.loads(tokenizer_file.read_bytes()).get("post_processor") if tokenizer_file.is_file() else None
        kinds = [p.get("type") for p in (post or {}).get("processors", [post or {}])]
        if kinds[:1] == ["ByteLevel"]:  # before the others, as the vendored loop meets it: the keys' order is its
            self._no_bos_eos()
        found = super()._try_load_from_tokenizer_json(path)
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
