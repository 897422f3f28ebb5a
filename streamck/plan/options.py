"""What a rewrite does to the tensors: one frozen object, checked where it is made.

``PlanOptions`` sits beside ``SourceSpec`` (what is read) and ``WriteOptions`` (how it is
written): streamck.api.build_plan compiles a SourceSpec with it, then runs the passes of
streamck.plan.passes.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from streamck.errors import UsageError
from streamck.plan.rules import Rule

EXPERTS = ("auto", "keep", "fuse")


@dataclass(frozen=True)
class PlanOptions:
    """The plan's options: ``rules`` (a plan file's rows, ``{"strip_prefix": "model."}``, or
    Rule objects, applied in order), ``dtype`` (every float tensor cast; on a quantized source,
    dequantized), ``casts`` (glob → dtype, over ``dtype``), ``copy_files`` (the config and
    tokenizer files go along), ``merge_lora`` (a PEFT adapter folder merged in as
    merge_and_unload does, with ``safe_merge``, ``merge_lora_any_base`` and ``merge_engine``
    ``"torch"`` or ``"numpy"``), ``experts`` (MoE: ``"auto"`` as save_pretrained writes them,
    ``"keep"``, ``"fuse"``), and ``quantize`` (a scheme such as ``"FP8_BLOCK"``) with
    ``quantize_ignore``, ``quantize_lm_head`` and ``quantize_pad_partial`` (FP8_BLOCK on a width
    no multiple of 128 written padded, as model_free_ptq writes it, rather than left
    unquantized: see streamck.plan.quant)."""

    rules: tuple[Rule | Mapping[str, str], ...] = ()
    dtype: str | None = None
    casts: Mapping[str, str] = field(default_factory=dict)
    copy_files: bool = True
    merge_lora: str | os.PathLike | None = None
    safe_merge: bool = False
    merge_lora_any_base: bool = False
    merge_engine: str | None = None
    experts: str = "auto"
    quantize: str | None = None
    quantize_ignore: Sequence[str] = ()
    quantize_lm_head: bool = False
    quantize_pad_partial: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", tuple(self.rules or ()))
        object.__setattr__(self, "casts", dict(self.casts or {}))
        object.__setattr__(self, "quantize_ignore", tuple(self.quantize_ignore or ()))
        lora = {"{safe_merge}": self.safe_merge, "{merge_engine}": self.merge_engine}
        lora["{merge_lora_any_base}"] = self.merge_lora_any_base
        stray = [flag for flag, value in lora.items() if value not in (None, False)]
        if self.merge_lora is None and stray:
            raise UsageError(f"{', '.join(stray)} applies to {{merge_lora}} only")
        if self.experts not in EXPERTS:
            raise UsageError(f"experts={self.experts!r}: one of {', '.join(EXPERTS)}")
        quant = {"{quantize_ignore}": self.quantize_ignore, "{quantize_lm_head}": self.quantize_lm_head}
        quant["{quantize_pad_partial}"] = self.quantize_pad_partial
        stray = [flag for flag, value in quant.items() if value]
        if stray and self.quantize is None:
            raise UsageError(f"{stray[0]} applies to {{quantize}} only")

    @classmethod
    def of(cls, options: PlanOptions | None = None, **changes: Any) -> PlanOptions:
        """``options`` (or the defaults) with ``changes`` (this class's fields) over them."""
        unknown = sorted(set(changes) - names(cls))
        if unknown:
            raise UsageError(f"unknown plan option(s): {', '.join(unknown)} (known: {', '.join(sorted(names(cls)))})")
        return replace(options or cls(), **changes)


def names(cls: type) -> set[str]:
    """A dataclass's field names."""
    return {f.name for f in fields(cls)}


def split_options(keywords: Mapping[str, Any], *classes: type) -> Iterable[dict[str, Any]]:
    """``keywords`` dealt out to the dataclasses ``classes`` by field name, one dict each;
    a name none of them has is a UsageError naming the known ones."""
    known = [names(c) for c in classes]
    unknown = sorted(set(keywords) - set().union(*known))
    if unknown:
        every = sorted(set().union(*known))
        raise UsageError(f"unknown option(s): {', '.join(unknown)} (known: {', '.join(every)})")
    return [{k: v for k, v in keywords.items() if k in fields_} for fields_ in known]
