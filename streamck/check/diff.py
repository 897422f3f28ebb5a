"""``streamck diff``: two key sets (checkpoints or manifests) compared, reported like a good diff.

Headers only unless asked: ``data=True`` streams the bytes of every common
tensor; digests are compared whenever one side carries them.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from streamck.errors import PlanError, StreamckError, UsageError
from streamck.globs import check_glob
from streamck.manifest import checkpoint_manifest, load_manifest
from streamck.source import Checkpoint, open_checkpoint
from streamck.storage import location


@dataclass
class Side:
    """One side of a diff: a manifest, and the checkpoint it came from if it was one."""

    label: str
    manifest: dict[str, Any]
    checkpoint: Checkpoint | None = None

    @property
    def tensors(self) -> dict[str, dict[str, Any]]:
        return self.manifest["tensors"]


def load_side(path: str | os.PathLike, *, key: str | None = None, zero: bool = False, keep_tied: bool = False) -> Side:
    """A checkpoint in any layout ``ls`` accepts (opened with ``key``, ``zero`` and
    ``keep_tied``, see open_checkpoint), or a manifest JSON file; either may be a URL."""
    path = location(path)
    if path.is_file() and path.suffix == ".json":
        try:
            manifest = load_manifest(path.read_bytes())
        except (OSError, ValueError) as e:
            raise StreamckError(f"cannot read as a manifest: {e}", path) from None
        if manifest is not None:
            return Side(str(path), manifest)
        if path.name.endswith(".index.json"):
            path = path.parent
        else:
            raise StreamckError("is JSON but not a manifest (no 'tensors' object)", path)
    ckpt = open_checkpoint(path, key=key, zero=zero, keep_tied=keep_tied)
    return Side(str(path), checkpoint_manifest(ckpt), ckpt)


@dataclass(frozen=True)
class DataDiff:
    name: str
    differing: int  # elements (bytes for dtypes numpy cannot read)
    numel: int
    max_abs: float | None  # None where the dtype is not a readable float


@dataclass
class DiffResult:
    """Everything that differs between ``a`` and ``b``; ``str()`` is the readable report."""

    a: str
    b: str
    count_a: int
    count_b: int
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    dtype: list[tuple[str, str, str]] = field(default_factory=list)
    shape: list[tuple[str, list[int], list[int]]] = field(default_factory=list)
    digest: list[str] = field(default_factory=list)
    data: list[DataDiff] = field(default_factory=list)
    files: list[str] = field(default_factory=list)  # whole files on both sides whose sha256 or size differ
    # Files on one side only: another layout of the same tensors (a .bin against a safetensors
    # manifest, resharded) has other files, which the tensors' comparison already judged.
    files_only_a: list[str] = field(default_factory=list)
    files_only_b: list[str] = field(default_factory=list)
    digests_compared: bool = False  # sha256 digests, where a side carried them
    data_compared: bool = False  # tensor bytes (data=True)
    files_compared: bool = False  # whole-file digests, where a manifest carried them

    @property
    def equal(self) -> bool:
        return not (self.only_a or self.only_b or self.dtype or self.shape or self.digest or self.data or self.files)

    def __bool__(self) -> bool:
        return not self.equal

    def to_json(self) -> dict[str, Any]:
        return {
            "a": self.a,
            "b": self.b,
            "equal": self.equal,
            "tensors_a": self.count_a,
            "tensors_b": self.count_b,
            "only_a": self.only_a,
            "only_b": self.only_b,
            "dtype_changed": [{"name": n, "a": x, "b": y} for n, x, y in self.dtype],
            "shape_changed": [{"name": n, "a": x, "b": y} for n, x, y in self.shape],
            "digest_changed": self.digest,
            "data_changed": [d.__dict__ for d in self.data],
            "file_changed": self.files,
            "files_only_a": self.files_only_a,
            "files_only_b": self.files_only_b,
            "compared": self.compared,
        }

    @property
    def compared(self) -> list[str]:
        """The properties of the common tensors that were compared."""
        found = ["names", "dtypes", "shapes"] + ["sha256"] * self.digests_compared + ["values"] * self.data_compared
        return found + ["whole files"] * self.files_compared

    def __str__(self) -> str:
        lines = [f"--- a: {self.a} ({self.count_a} tensors)", f"+++ b: {self.b} ({self.count_b} tensors)"]

        def section(title: str, items: list[str]) -> None:
            if items:
                lines.append(title)
                lines.extend(items)

        section(f"only in a ({len(self.only_a)}):", [f"  - {p}" for p in collapse(self.only_a)])
        section(f"only in b ({len(self.only_b)}):", [f"  + {p}" for p in collapse(self.only_b)])
        section(f"dtype changed ({len(self.dtype)}):", _changes(self.dtype))
        section(f"shape changed ({len(self.shape)}):", _changes(self.shape))
        section(f"digest changed ({len(self.digest)}):", [f"  ! {p}" for p in collapse(self.digest)])
        section(
            f"data changed ({len(self.data)}):",
            [
                f"  ! {d.name}: {d.differing} of {d.numel} elements differ"
                + (f", max |a-b| = {d.max_abs:.6g}" if d.max_abs is not None else "")
                for d in self.data
            ],
        )
        section(f"file changed ({len(self.files)}):", [f"  ! {f}" for f in self.files])
        note = self.files_note()
        if note:
            lines.append(note)
        if self.equal:
            lines.append(self.same())
        return "\n".join(lines)

    def files_note(self) -> str | None:
        """A line naming the files that only one side has: not a difference, since the tensors
        in them were compared one by one (say so when they all matched)."""
        if not (self.files_only_a or self.files_only_b):
            return None
        sides = [f"{s}: {', '.join(n)}" for s, n in (("a", self.files_only_a), ("b", self.files_only_b)) if n]
        matched = " the tensors in them match," if self.equal else ""
        return f"files on one side only ({'; '.join(sides)}):{matched} whole files not compared"

    def same(self) -> str:
        """What "equal" means here: which properties of the tensors were compared."""
        if self.data_compared or self.digests_compared or self.files_compared:
            return f"same {self.count_a} tensors: {', '.join(self.compared[:-1])} and {self.compared[-1]}"
        return f"same {self.count_a} tensors: names, dtypes, shapes; values not compared (--data compares them)"


def _changes(items: list[tuple[str, Any, Any]]) -> list[str]:
    by_change: dict[tuple[str, str], list[str]] = {}
    for name, x, y in items:
        by_change.setdefault((json.dumps(x), json.dumps(y)), []).append(name)
    return [
        f"  ~ {p}: {x.strip(chr(34))} -> {y.strip(chr(34))}"
        for (x, y), names in by_change.items()
        for p in collapse(names)
    ]


_NUM = re.compile(r"(\d+)")


def _ranges(values: set[int]) -> str:
    ordered, parts, i = sorted(values), [], 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}..{ordered[j]}")
        i = j + 1
    return "{" + ",".join(parts) + "}"


def collapse(names: list[str]) -> list[str]:
    """Fold names that differ only in numbers: ``layers.{0..79}.mlp.up_proj.weight``.

    Numbers are folded one position at a time (last first), so names varying in
    two places (experts within layers) fold into one pattern too where the sets agree.
    """
    items: dict[tuple, None] = {}
    for name in names:
        parts = _NUM.split(name)
        items[(tuple(parts[0::2]), tuple(frozenset({int(n)}) for n in parts[1::2]))] = None
    rows = list(items)
    width = max((len(v) for _, v in rows), default=0)
    for pos in reversed(range(width)):
        merged: dict[tuple, set[int]] = {}
        for template, values in rows:
            if pos >= len(values):
                merged.setdefault((template, values, -1), set())
                continue
            key = (template, values[:pos] + values[pos + 1 :], pos)
            merged.setdefault(key, set()).update(values[pos])
        rows = []
        for (template, rest, p), union in merged.items():
            rows.append((template, rest if p < 0 else (*rest[:p], frozenset(union), *rest[p:])))
    out = []
    for template, values in rows:
        text = template[0]
        for v, literal in zip(values, template[1:], strict=True):
            text += (str(next(iter(v))) if len(v) == 1 else _ranges(set(v))) + literal
        out.append(text)
    return sorted(out)


def _compare_data(a: Checkpoint, b: Checkpoint, names: list[str]) -> list[DataDiff]:
    from streamck.check.data import compare_tensor

    found = ((name, compare_tensor(a.tensors[name], b.tensors[name])) for name in names)
    return [DataDiff(name, *d) for name, d in found if d is not None]


def diff(
    a: str | os.PathLike | Side, b: str | os.PathLike | Side, *, ignore: tuple[str, ...] = (), data: bool = False
) -> DiffResult:
    """Compare two checkpoints or manifests: names, dtypes, shapes; digests where either
    side has them; tensor bytes with ``data=True`` (both sides must be checkpoints).
    ``ignore`` globs leave names out of every comparison (checked first, as rewrite's are)."""
    for glob in ignore:
        try:
            check_glob(glob)
        except PlanError as e:
            raise UsageError(f"{{ignore}}: {e.message}") from None
    sa = a if isinstance(a, Side) else load_side(a)
    sb = b if isinstance(b, Side) else load_side(b)
    if data and (sa.checkpoint is None or sb.checkpoint is None):
        raise UsageError("{data} compares tensor bytes: both sides must be checkpoints, not manifests")
    ignored = re.compile("|".join(fnmatch.translate(g) for g in ignore)) if ignore else None
    ta = {n: e for n, e in sa.tensors.items() if not (ignored and ignored.match(n))}
    tb = {n: e for n, e in sb.tensors.items() if not (ignored and ignored.match(n))}
    result = DiffResult(sa.label, sb.label, len(ta), len(tb))
    result.only_a = sorted(set(ta) - set(tb))
    result.only_b = sorted(set(tb) - set(ta))
    common = sorted(set(ta) & set(tb))
    same_layout = []
    for n in common:
        ea, eb = ta[n], tb[n]
        if ea["dtype"] != eb["dtype"]:
            result.dtype.append((n, ea["dtype"], eb["dtype"]))
        if list(ea["shape"]) != list(eb["shape"]):
            result.shape.append((n, list(ea["shape"]), list(eb["shape"])))
        if ea["dtype"] == eb["dtype"] and list(ea["shape"]) == list(eb["shape"]):
            same_layout.append(n)
    digests = _compare_digests(sa, sb, same_layout)
    result.digest, result.digests_compared = digests or [], digests is not None
    if data:
        result.data, result.data_compared = _compare_data(sa.checkpoint, sb.checkpoint, same_layout), True
    if not ignore:  # a file holds the ignored tensors too
        files = _compare_files(sa, sb)
        if files is not None:
            # whole files were compared only where a file of the same name is on both sides
            result.files, result.files_only_a, result.files_only_b, common = files
            result.files_compared = common > 0
    return result


def _compare_files(sa: Side, sb: Side) -> tuple[list[str], list[str], list[str], int] | None:
    """The files (by path under the root) on both sides whose digest or size differ, the files
    only ``sa`` has, those only ``sb`` has, and how many both have; None when neither side is a
    manifest carrying ``files`` (a checkpoint's are hashed only then)."""
    from streamck.check.digest import file_digests

    fa, fb = sa.manifest.get("files"), sb.manifest.get("files")
    if fa is None and fb is None:
        return None
    fa = fa if fa is not None else file_digests(sa.checkpoint) if sa.checkpoint is not None else None
    fb = fb if fb is not None else file_digests(sb.checkpoint) if sb.checkpoint is not None else None
    if fa is None or fb is None:
        return None
    common = set(fa) & set(fb)
    changed = sorted(n for n in common if fa[n] != fb[n])
    return changed, sorted(set(fa) - set(fb)), sorted(set(fb) - set(fa)), len(common)


def _compare_digests(sa: Side, sb: Side, names: list[str]) -> list[str] | None:
    """The names whose digests differ; None when the digests are not compared (neither side has them)."""
    from streamck.check.digest import ALGORITHM, tensor_digests

    def digests(side: Side, other: Side) -> dict[str, str] | None:
        have = {n: e[ALGORITHM] for n, e in side.tensors.items() if ALGORITHM in e}
        if have:
            return have
        wanted = [n for n in names if ALGORITHM in other.tensors[n]]
        if side.checkpoint is not None and wanted:
            return tensor_digests(side.checkpoint, wanted)
        return None

    da, db = digests(sa, sb), digests(sb, sa)
    if da is None or db is None:
        return None
    return [n for n in names if n in da and n in db and da[n] != db[n]]
