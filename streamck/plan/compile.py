"""Compile rules against a checkpoint into the exact list of output tensors."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from streamck.dtypes import CASTABLE, TORCH_NAMES, nbytes
from streamck.errors import PlanError, listing
from streamck.plan.rules import Rules
from streamck.source import Checkpoint, TensorRef
from streamck.source.header import METADATA_KEY
from streamck.source.layout import side_files
from streamck.transforms import Transform


@dataclass(frozen=True, slots=True)
class OutputTensor:
    """One tensor of the output: its name, its source, the dtype it is written in, and, when
    its bytes are computed rather than copied or cast, the transform that computes them
    (a LoRA merge, streamck.transforms) with the output's shape where that differs."""

    name: str
    source: TensorRef
    dtype: str
    transform: Transform | None = None
    out_shape: tuple[int, ...] | None = None
    # Computed once: layout, headers, progress and totals ask for them several times per
    # tensor, ~0.5M calls each for a 92k-tensor copy (#44).
    _nbytes: int = field(init=False, repr=False, compare=False)
    _is_cast: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_nbytes", nbytes(self.dtype, math.prod(self.shape)))
        object.__setattr__(self, "_is_cast", self.dtype != self.source.dtype and self.transform is None)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape if self.out_shape is None else self.out_shape

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def is_cast(self) -> bool:
        """Whether the bytes are the source's cast to ``dtype`` on the way (no transform)."""
        return self._is_cast


@dataclass
class Plan:
    """Everything a rewrite writes: tensors, header metadata, and small files beside them.

    ``files`` must be written beside the tensors (so the output must be a directory);
    ``side_files`` go there when it is one (config, tokenizer): a path (a file, or a folder
    copied whole) is copied, bytes (a config edited for a cast) are written. ``summary``
    holds lines a dry run prints above the tensor table; ``notices`` lines a user should
    hear (rules that did nothing), which the library never prints; ``single_file`` forbids
    sharding (a plan whose consumer loads exactly one model.safetensors).
    """

    tensors: list[OutputTensor]
    metadata: dict[str, str]
    files: dict[str, bytes] = field(default_factory=dict)
    source: Checkpoint | None = None
    summary: list[str] = field(default_factory=list)
    single_file: bool = False
    side_files: dict[str, Path | bytes] = field(default_factory=dict)
    notices: list[str] = field(default_factory=list)

    @property
    def total_size(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def resolve_dtype(rules: Rules, ref: TensorRef, used: set[int] | None = None) -> str:
    """The dtype ``ref`` is written in under ``rules``; a --cast naming a non-float tensor is an error.
    ``used`` collects the index of the deciding --cast (see Rules.unused)."""
    explicit = rules.cast_for(ref.name, used)
    if explicit is not None and ref.dtype not in CASTABLE:
        article = "an" if ref.dtype[0] in "IF" else "a"  # an I64, an F8_E4M3; a U8, a BOOL
        raise PlanError(f"{{cast}} matches {ref.name!r}, {article} {ref.dtype} tensor, which is never cast")
    dtype = explicit or (rules.dtype if rules.dtype is not None and ref.dtype in CASTABLE else ref.dtype)
    return dtype


def compile_plan(checkpoint: Checkpoint, rules: Rules | None = None, *, copy_files: bool = True) -> Plan:
    """Apply ``rules`` to every tensor of ``checkpoint`` and return the output plan.

    With ``copy_files``, a directory checkpoint's other files (config, tokenizer, custom
    code: see side_files) go along, copied when the output is a directory. Raises PlanError, before anything is
    written, when two tensors land on one name, when nothing is left, or when a cast
    names a non-floating tensor.
    """
    rules = rules or Rules()
    tensors = []
    used: set[int] = set()
    for ref in checkpoint.tensors.values():
        out = rules.output_name(ref.name, used)
        if out is not None:
            tensors.append(OutputTensor(out, ref, resolve_dtype(rules, ref, used)))
    names = {t.name for t in tensors}
    if len(names) != len(tensors) or "" in names or METADATA_KEY in names:  # a list of sources per name only then
        by_name: dict[str, list[str]] = defaultdict(list)
        for t in tensors:
            by_name[t.name].append(t.source.name)
        _check_names(by_name)
    if not tensors and checkpoint.tensors:  # a checkpoint of no tensors rewrites to an empty file
        raise PlanError(f"the rules leave no tensor out of {len(checkpoint.tensors)}")
    metadata = {**checkpoint.metadata}
    metadata.setdefault("format", "pt")
    tensors.sort(key=lambda t: t.name)
    side: dict[str, Path | bytes] = {}
    summary: list[str] = []
    linked_out: list[str] = []
    if copy_files and not checkpoint.path.is_file():  # a directory, or a repo id that resolved to one
        side = dict(side_files(checkpoint.side_root or checkpoint.root, linked_out))
        if rules.dtype and "config.json" in side:
            side["config.json"], summary = _config_cast(side["config.json"], rules.dtype)
        if side:
            names = [n + "/" if isinstance(p, Path) and p.is_dir() else n for n, p in side.items()]
            summary.append(f"copied into a directory output: {', '.join(names)}")
    plan = Plan(tensors, metadata, source=checkpoint, summary=summary, side_files=side)
    plan.notices = rules.unused(used)
    if linked_out:
        plan.notices.append(f"not copied, links out of the checkpoint: {listing(linked_out)}")
    return plan


def _more(items: list[str], shown: int) -> str:
    return f" (+{len(items) - shown} more)" if len(items) > shown else ""


def _check_names(by_name: dict[str, list[str]]) -> None:
    """Refuse output names two sources share, or that no file can hold. A rename gone wrong
    can send thousands of tensors to one name: the message shows counts and the first few pairs."""
    collisions = [(out, srcs) for out, srcs in by_name.items() if len(srcs) > 1]
    if collisions:
        pairs = [f"{', '.join(srcs[:2])}{_more(srcs, 2)} -> {out}" for out, srcs in collisions]
        raise PlanError(f"{len(collisions)} output names collide: {listing(pairs, 5)}")
    bad = [repr(n) for n in by_name if not n or n == METADATA_KEY]
    if bad:
        raise PlanError(f"rules produce invalid tensor names: {listing(bad)}")


def _config_cast(path: Path, dtype: str) -> tuple[Path | bytes, list[str]]:
    """``config.json`` with its top-level ``torch_dtype`` (transformers 5: ``dtype``) set to
    the ``--dtype`` cast's, and a line saying so; the file itself when there is nothing to
    change. Loaders pick the compute dtype from it (``torch_dtype="auto"``, vLLM), and a
    float32 label on bf16 weights would have them serve in float16 or float32."""
    try:
        config = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return path, []  # not ours to judge: copied as is
    name = TORCH_NAMES[dtype]
    keys = [k for k in ("torch_dtype", "dtype") if isinstance(config, dict) and config.get(k, name) != name]
    if not keys or any(not isinstance(config[k], str) for k in keys):  # a per-module map: not ours to flatten
        return path, []
    lines = [f"config.json: {k} {config[k]} -> {name}" for k in keys]
    config.update(dict.fromkeys(keys, name))
    return (json.dumps(config, indent=2) + "\n").encode(), lines
