"""Which files of a checkpoint at a URL hold its weights: safetensors only, for now.

A URL names one ``.safetensors`` object, an index (``model.safetensors.index.json``), or a
folder (a key prefix) holding an index and its shards or ``*.safetensors`` files; its
listing is one request, and fsspec keeps it for the questions after. Any other format
(torch pickles, DCP, ZeRO, trainer folders) is refused by name: it is not read from URLs yet.
"""

from __future__ import annotations

import fnmatch

from streamck.errors import CheckpointError
from streamck.source.layout import DCP_METADATA, DCP_SHARDS, INDEX_NAMES, Layout, from_index, incomplete
from streamck.storage import UrlPath
from streamck.storage.remote import info, listdir

SAFETENSORS_INDEX = INDEX_NAMES[0]
# Names that say a folder holds weights in a format not read from URLs yet.
OTHER_FORMATS = (
    "pytorch_model*.bin",
    "*.pt",
    "*.pth",
    "*.bin",
    "*.distcp",
    DCP_METADATA,
    DCP_SHARDS,
    "global_step*",
    "latest",
    "model",
    "actor",
)


def not_yet(url: UrlPath, what: str) -> CheckpointError:
    return CheckpointError(
        f"{what}: only safetensors files and folders (with or without an index) are read from URLs yet; "
        "copy it to a local folder first",
        url,
    )


def remote_layout(url: UrlPath) -> Layout:
    """The weights at ``url``, or a CheckpointError saying what is there instead."""
    found = info(url)
    if found is None:
        raise CheckpointError("no such file or directory (or bucket)", url)
    if found.get("type") == "file":
        if url.name == SAFETENSORS_INDEX:
            return remote_layout(url.parent)
        if url.name.endswith(".safetensors"):
            return Layout(url.parent, [url])
        raise not_yet(url, "not a .safetensors file")
    entries = listdir(url)
    files = {name for name, e in entries.items() if e.get("type") == "file"}
    if SAFETENSORS_INDEX in files:
        return from_index(url, url / SAFETENSORS_INDEX)
    shards = sorted(url / n for n in files if fnmatch.fnmatchcase(n, "*.safetensors"))
    if shards and not any(fnmatch.fnmatchcase(s.name, DCP_SHARDS) for s in shards):
        refused = incomplete(url, shards)
        if refused:
            raise refused
        return Layout(url, shards)  # training state beside them (optimizer.pt …) is never weights
    other = sorted(n for n in entries if any(fnmatch.fnmatchcase(n, g) for g in (*OTHER_FORMATS, INDEX_NAMES[1])))
    if other:
        raise not_yet(url, f"holds {', '.join(other[:4])}")
    raise CheckpointError(f"no weights here (looked for {SAFETENSORS_INDEX}, *.safetensors)", url)
