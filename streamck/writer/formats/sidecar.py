"""A built-in plan's export as the Hugging Face folder a converter reads (GGUF and MLX output).

A built-in plan (``--plan torchtitan``, ``megatron-gpt``, ``olmo2`` …) writes its own
``config.json`` (``plan.files``, bytes: the model's config, its dtype the weights') and, but
for verl's, no tokenizer. ``convert_hf_to_gguf.py`` and ``mlx_lm.convert`` read the config and
the tokenizer from one folder, and so do streamck's GGUF and MLX formats. ``model_folder`` makes
that folder: what ``-o DIR`` with the plan writes beside its weights (its ``config.json`` and side
files), and, where those hold no tokenizer, the tokenizer's files and ``generation_config.json``
from the first folder that holds a tokenizer of: the source's side root (``--hf-config``'s
folder: streamck.spec sets it), the step, the folder above the step (where the plans look
for ``config.json``). So one command writes what two would: ``-o DIR`` with the plan, the
tokenizer copied beside, then ``streamck rewrite DIR -o model.gguf`` (or ``--format mlx``);
the folder's name is the tokenizer folder's, as the reference names a model after its folder.

The folder holds the config and links to the files (a few KiB), under one temporary folder per
process, removed when the process exits.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from streamck.errors import PlanError
from streamck.plan import Plan
from streamck.source.layout import side_files

# What marks a folder as holding the model's tokenizer (BPE, SentencePiece).
TOKENIZERS = ("tokenizer.json", "tokenizer.model")
# What is taken from the tokenizer's folder: the files a tokenizer's save_pretrained writes, and
# the generation config (the GGUF's sampling keys, mlx-lm's eos_token_id).
TOKENIZER_FILES = (
    *TOKENIZERS,
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
_ROOT: list[Path] = []  # this process's temporary folder, made on first use
_MADE: dict[Path, str] = {}  # each folder made: where its files come from, in words


def exported_config(plan: Plan) -> bytes | None:
    """The ``config.json`` a built-in plan writes (bytes), or None for a plan that copies the source's."""
    body = plan.files.get("config.json")
    return body if isinstance(body, bytes) else None


def model_folder(plan: Plan, output: str) -> tuple[dict[str, Any], Path]:
    """The config a built-in plan writes, parsed, and a folder holding it as ``config.json`` with
    the tokenizer's files beside (see the module). ``output`` names the format in messages
    (``"GGUF"``). PlanError where the plan writes no config of its own, or no tokenizer is found."""
    body = exported_config(plan)
    if body is None:
        raise PlanError(f"{output} output: this plan writes no config.json of its own")
    config = json.loads(body)
    files: dict[str, Path | bytes] = {**plan.side_files, **plan.files}
    own = next((p for n in TOKENIZERS if isinstance(p := files.get(n), Path)), None)  # verl's huggingface/
    name = own.parent.name if own is not None else "model"
    origin = f"the plan's config.json and the tokenizer in {own.parent}" if own is not None else ""
    if not any(n in files for n in TOKENIZERS):
        where = tokenizer_folder(plan, output)
        name = where.name or name
        found = side_files(where)
        files |= {n: p for n, p in found.items() if n in TOKENIZER_FILES and n not in files}
        origin = f"the plan's config.json and the tokenizer in {where}"
    folder = _made(name, files)
    _MADE[folder] = origin or "the plan's config.json and side files"
    return config, folder


def describe(folder: Path) -> str:
    """Where a model folder's config and tokenizer come from, for a dry run's summary: the
    folder itself, or for one model_folder made, what it holds."""
    return _MADE.get(folder, str(folder))


def tokenizer_folder(plan: Plan, output: str) -> Path:
    """The first of the source's side root, its root and the folder above that holds a
    tokenizer; PlanError naming where it looked where none does."""
    looked: list[Path] = []
    src = plan.source
    for where in (src.side_root, src.root, src.root.parent) if src is not None else ():
        if where is not None and where not in looked:
            looked.append(where)
            if any((where / n).is_file() for n in TOKENIZERS):
                return where
    places = ", ".join(str(p) for p in looked) or "the plan's source"
    raise PlanError(
        f"{output} output needs the model's tokenizer ({' or '.join(TOKENIZERS)}) beside its config, and none is "
        f"in {places}: give {{hf_config}} the model's Hugging Face folder, which holds it"
    )


def _made(name: str, files: dict[str, Path | bytes]) -> Path:
    """A new folder ``name`` holding ``files``: bytes written, local paths linked, a URL's copied
    (the readers of a tokenizer read local files)."""
    if not _ROOT:
        _ROOT.append(Path(tempfile.mkdtemp(prefix="streamck-model-")))
        atexit.register(shutil.rmtree, _ROOT[0], True)
    folder = Path(tempfile.mkdtemp(dir=_ROOT[0])) / name
    folder.mkdir()
    for n, data in files.items():
        if isinstance(data, Path):
            (folder / n).symlink_to(data.resolve())
        else:
            (folder / n).write_bytes(data if isinstance(data, bytes) else data.read_bytes())
    return folder
