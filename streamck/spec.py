"""Which checkpoint, read how: the one description every command and library call takes.

``ls``, ``rewrite``, ``diff`` and ``hash`` (the CLI's and streamck.api's) all read their source
through a ``SourceSpec``: a path (any layout streamck reads, a run root with ``step``), how to
read it (``key``, ``zero``, ``keep_tied``), and optionally a plan (a built-in plan with its
options, or a TOML plan file), in which case what the command sees is what the plan would write.
The plans are imported only when one is named: ``ls`` of a plain checkpoint (a key-set check
in CI) pays for the source layer alone.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

from streamck.errors import UsageError
from streamck.source import Checkpoint, open_checkpoint
from streamck.source.checkpoint import resolve_step
from streamck.source.producers import plan_hint
from streamck.storage import is_url, location

if TYPE_CHECKING:
    from streamck.plan import Plan, Rules

PathLike = str | os.PathLike


@dataclass(frozen=True)
class SourceSpec:
    """A source and how to read it.

    ``path`` is a checkpoint (any layout open_checkpoint reads) or an opened Checkpoint;
    ``step`` picks a run root's step (a number or ``"latest"``); ``key``, ``zero`` and
    ``keep_tied`` are open_checkpoint's. ``plan`` names a built-in plan (``"megatron-gpt"``)
    or a TOML plan file whose rules run first; ``hf_config`` (torchtitan, megatron),
    ``verifier`` (eagle3-speculators) and ``aux_layer_ids`` (eagle3) are a built-in plan's options.
    ``remote_concurrency`` is the requests in flight per file of a URL, read or written, for the
    calls given this spec (streamck.storage.requests_in_flight; None: the environment's or 4).
    """

    path: PathLike | Checkpoint
    step: str | int | None = None
    key: str | None = None
    zero: bool = False
    keep_tied: bool = False
    plan: PathLike | None = None
    hf_config: PathLike | None = None
    verifier: str | None = None
    aux_layer_ids: Sequence[int] | str | None = None
    remote_concurrency: int | None = None

    @classmethod
    def of(cls, source: PathLike | Checkpoint | SourceSpec, **options) -> SourceSpec:
        """``source`` as a spec, with ``options`` (this class's fields) over what it says.
        Raises UsageError for an option it does not know."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise UsageError(f"unknown source option(s): {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        if isinstance(source, SourceSpec):
            given = {k: v for k, v in options.items() if v not in (None, False)}
            return cls(**{**{f.name: getattr(source, f.name) for f in fields(cls)}, **given})
        return cls(source, **options)

    @property
    def builtin(self) -> str | None:
        """The built-in plan's name, if the plan is one."""
        if self.plan is None:
            return None
        from streamck.plan import BUILTIN_PLANS

        return os.fspath(self.plan) if os.fspath(self.plan) in BUILTIN_PLANS else None

    def open(self) -> Checkpoint:
        """The source's index (headers only). A built-in plan opens its own source: asking
        for the index of one is a UsageError (use ``compile``)."""
        if self.builtin is not None:
            raise UsageError(f"{{plan}} {self.builtin} opens its own source; compile the plan instead")
        if isinstance(self.path, Checkpoint):
            return self.path
        return open_checkpoint(self.path, self.step, self.key, self.zero, self.keep_tied)

    def compile(self, rules: Rules | None = None, *, copy_files: bool = True) -> Plan:
        """What a rewrite of this source writes under ``rules`` (after a plan file's own)."""
        from streamck.plan import BUILTIN_PLANS, Rules, compile_plan

        rules = Rules() if rules is None else rules
        self._check_plan_options()
        name = self.builtin
        if name is None:
            base = _plan_file(self.plan) if self.plan is not None else Rules()
            plan = compile_plan(self.open(), base + rules, copy_files=copy_files)
            hint = plan_hint(plan.source.tensors) if self.plan is None else None
            plan.notices[:0] = [hint] if hint else []  # a trainer's step that a built-in plan exports
            return plan
        if isinstance(self.path, Checkpoint):
            raise UsageError(f"plan {name!r} opens its own source: pass a path, not a Checkpoint")
        if self.key is not None or self.zero or self.keep_tied:
            which = "{key}, {zero} and {keep_tied} do not apply to {plan}"
            raise UsageError(f"{which} {name}, which opens its own source")
        if is_url(self.path):  # listings fsspec kept from an earlier open may miss a new step
            from streamck.storage.remote import forget

            forget(location(self.path))
        path, picked = resolve_step(location(self.path), self.step) if self.step is not None else (self.path, [])
        extra = {"verifier": self.verifier, "aux_layer_ids": self.aux_layer_ids, "hf_config": self.hf_config}
        plan = BUILTIN_PLANS[name](path, rules, **{k: v for k, v in extra.items() if v is not None})
        plan.notices[:0] = picked
        if self.hf_config is not None and plan.source is not None:  # its tokenizer's folder (GGUF, MLX output)
            given = location(self.hf_config)
            plan.source = replace(plan.source, side_root=given if given.is_dir() else given.parent)
        return plan

    def _check_plan_options(self) -> None:
        """A built-in plan's option given without that plan is a UsageError naming the plans that take it."""
        from streamck.plan import AUX_LAYER_PLANS, HF_CONFIG_PLANS, VERIFIER_PLANS

        for flag, value, plans in (
            ("{verifier}", self.verifier, VERIFIER_PLANS),
            ("{aux_layer_ids}", self.aux_layer_ids, AUX_LAYER_PLANS),
            ("{hf_config}", self.hf_config, HF_CONFIG_PLANS),
        ):
            if value is not None and self.builtin not in plans:
                where = f", not {self.builtin}" if self.builtin else ""
                raise UsageError(f"{flag} applies to {{plan}} {', '.join(sorted(plans))} only{where}")


def _plan_file(plan: str | os.PathLike) -> Rules:
    """The rules of a TOML plan file; a name that is neither a file nor a built-in plan is a
    UsageError naming the closest built-in plan and all of them (``--plan torchtitn``)."""
    from difflib import get_close_matches

    from streamck.plan import BUILTIN_PLANS, load_rules

    if not os.path.exists(plan) and os.sep not in os.fspath(plan) and not Path(plan).suffix:
        names = list(BUILTIN_PLANS)
        close = get_close_matches(os.fspath(plan), names, n=1, cutoff=0.6)
        guess = f"did you mean {close[0]}? " if close else ""
        what = f"{{plan}} {os.fspath(plan)}: no such built-in plan or plan file"
        raise UsageError(f"{what}; {guess}the built-in plans: {', '.join(names)}")
    return load_rules(plan)
