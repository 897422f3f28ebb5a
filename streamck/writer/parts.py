"""``--part K/N``: one output written by N independent runs, each writing its share of files.

The layout is computed before a byte is written, and it is the same in every run, so
the shards can be split among runs (a Slurm array, Ray tasks, a Kubernetes indexed
Job) with no coordination: part K writes its own shards, each file atomically and
straight into the output directory, plus the index and side files, whose bytes are
the same from every part. Once all N parts have run, in any order or at once, the
directory is byte-identical to a single run's; rerunning a part rewrites its files only.
"""

from __future__ import annotations

import re
from pathlib import Path

from streamck.errors import OutputError, UsageError, listing
from streamck.writer.atomic import is_temporary
from streamck.writer.layout import Shard

_PART = re.compile(r"^(\d+)/(\d+)$")


def parse_part(text: str) -> tuple[int, int]:
    """``K/N`` (1 ≤ K ≤ N) as the 1-based pair."""
    m = _PART.match(text.strip())
    if m is None or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise UsageError(f"{{part}} {text!r}: give K/N with 1 <= K <= N, e.g. 2/8")
    return int(m.group(1)), int(m.group(2))


def assign(shards: list[Shard], parts: int) -> list[int]:
    """The part (0-based) of each shard: largest shards first, each to the part with the
    fewest bytes so far (the lowest-numbered on a tie). Deterministic, balanced by bytes."""
    load, owner = [0] * parts, [0] * len(shards)
    for i in sorted(range(len(shards)), key=lambda i: (-shards[i].size, i)):
        p = min(range(parts), key=lambda p: (load[p], p))
        owner[i] = p
        load[p] += shards[i].size
    return owner


def check_directory(out: Path, names: list[str]) -> None:
    """The output directory may hold only this output's files (other parts' finished files,
    this part's from an earlier try) and the temporaries of parts still running."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise OutputError("{part} writes into a directory, and this is not one", out)
    if not out.exists():
        return
    ours = set(names)
    other = sorted(p.name for p in out.iterdir() if p.name not in ours and not is_temporary(p.name))
    if other:
        raise OutputError(
            f"holds files that are not part of this output: {listing(other)}; {{part}} writes only into a "
            "directory that is empty or holds this output's own files",
            out,
        )
