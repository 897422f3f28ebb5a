"""What a file that is not safetensors looks like, from its first bytes: for the one-line
error a user gets when they give streamck the wrong file (a script, a zip, a pickle)."""

from __future__ import annotations

import re

# First bytes, what they mark. Pickle protocols 2 and up start with the PROTO opcode (torch.save's
# legacy, pre-1.6 files too); protocols 0 and 1 have no mark and read as text or binary.
MAGIC = (
    (b"PK\x03\x04", "a zip archive (torch.save writes one)"),
    (b"\x80\x02", "a pickle (torch.save's legacy format, or pickle.dump)"),
    (b"\x80\x03", "a pickle (torch.save's legacy format, or pickle.dump)"),
    (b"\x80\x04", "a pickle (pickle.dump)"),
    (b"\x80\x05", "a pickle (pickle.dump)"),
    (b"\x1f\x8b", "gzip-compressed data"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed data"),
    (b"GGUF", "a GGUF file (llama.cpp)"),
    (b"\x93NUMPY", "a numpy .npy array"),
    (b"\x89HDF\r\n\x1a\n", "an HDF5 file (Keras .h5)"),
)
# The start of a JSON object or array (a TOML file's ``[section]`` is not one).
JSON_START = re.compile(r'\s*(\{\s*["}]|\[\s*[\[{"\d\]-])')
# A Git LFS pointer's first line (https://github.com/git-lfs/git-lfs/blob/main/docs/spec.md): what a
# clone without git-lfs, or with GIT_LFS_SKIP_SMUDGE, leaves where the weights should be.
LFS_POINTER = "version https://git-lfs.github.com/spec/"
# How many bytes are looked at, and how much of a text's first line is shown.
SAMPLE, SHOWN = 512, 40


def looks_like(sample: bytes) -> str | None:
    """What ``sample`` (a file's first bytes) looks like: a known format, JSON text or text
    (with its first line's start); None for binary data of no kind known here."""
    for magic, what in MAGIC:
        if sample.startswith(magic):
            return what
    try:
        text = sample.decode("utf-8")
    except UnicodeDecodeError as e:  # a sample may end inside a character
        text = sample[: e.start].decode("utf-8") if e.start > len(sample) - 4 else ""
    if not text or any(not (c.isprintable() or c in "\t\n\r") for c in text):
        return None
    if text.startswith(LFS_POINTER):
        return "a Git LFS pointer, not the file it stands for: run `git lfs pull` in its repository"
    if JSON_START.match(text):
        return "JSON text (a config or an index? give the checkpoint's directory)"
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"text ({first[:SHOWN]!r}{'…' if len(first) > SHOWN else ''})" if first else "text (blank)"
