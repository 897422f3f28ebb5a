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

The folder holds copies of the config and the files (the tokenizer's: a few MiB), under one
temporary folder per process, removed when the process exits.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

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


def model_folder(plan: Plan, output: str) -> Path:
    """A folder holding the config a built-in plan writes (``exported_config``: not None) as
    ``config.json``, with the tokenizer's files beside (see the module). ``output`` names the
    format in messages (``"GGUF"``). PlanError where no tokenizer is found."""
    files: dict[str, Path | bytes] = {**plan.side_files, **plan.files}
    # verl's huggingface/ (a local path or a URL's)
    own = next((p for n in TOKENIZERS if (p := files.get(n)) is not None and not isinstance(p, bytes)), None)
    name = own.parent.name if own is not None else "model"
    origin = f"the plan's config.json and the tokenizer in {own.parent}" if own is not None else ""
    if not any(n in files for n in TOKENIZERS):
        where, found = tokenizer_folder(plan, output)
        name = where.name or name
        files |= {n: p for n, p in found.items() if n in TOKENIZER_FILES and n not in files}
        origin = f"the plan's config.json and the tokenizer in {where}"
    folder = _made(name, files)
    _MADE[folder] = origin or "the plan's config.json and side files"
    return folder


def describe(folder: Path) -> str:
    """Where a model folder's config and tokenizer come from, for a dry run's summary: the
    folder itself, or for one model_folder made, what it holds."""
    return _MADE.get(folder, str(folder))


def tokenizer_folder(plan: Plan, output: str) -> tuple[Path, dict[str, Path]]:
    """The first of the source's side root, its root and the folder above that holds a
    tokenizer, and its side files (streamck.source.layout.side_files: a link out of the folder
    is not followed); PlanError naming where it looked, and the links it left, where none does."""
    looked: list[Path] = []
    linked: list[str] = []
    src = plan.source
    for where in (src.side_root, src.root, src.root.parent) if src is not None else ():
        if where is not None and where not in looked and where.is_dir():
            looked.append(where)
            out: list[str] = []
            found = side_files(where, out)
            if any(n in found for n in TOKENIZERS):
                return where, found
            linked += [str(where / n) for n in out if n in TOKENIZERS]
    places = ", ".join(str(p) for p in looked) or "the plan's source"
    left = f" ({', '.join(linked)} links out of its folder: not followed)" if linked else ""
    raise PlanError(
        f"{output} output needs the model's tokenizer ({' or '.join(TOKENIZERS)}) beside its config, and none is "
        f"in {places}{left}: give {{hf_config}} the model's Hugging Face folder, which holds it"
    )


def _made(name: str, files: dict[str, Path | bytes]) -> Path:
    """A new folder ``name`` holding copies of ``files`` (the readers of a tokenizer read local
    files; a link would lead out of the folder, which MLX's side files do not follow); folders
    (a sentence-transformers module) left out: neither converter reads one."""
    if not _ROOT:
        _ROOT.append(Path(tempfile.mkdtemp(prefix="streamck-model-")))
        atexit.register(shutil.rmtree, _ROOT[0], True)
    folder = Path(tempfile.mkdtemp(dir=_ROOT[0])) / name
    folder.mkdir()
    for n, data in files.items():
        if isinstance(data, bytes):
            (folder / n).write_bytes(data)
        elif not data.is_file():
            continue
        elif isinstance(data, Path):
            shutil.copyfile(data, folder / n)
        else:  # a URL's
            (folder / n).write_bytes(data.read_bytes())
    return folder
