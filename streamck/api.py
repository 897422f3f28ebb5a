"""One call per command: what the CLI does, as functions a program can import.

Each opens the source, compiles the plan and writes or reports, with the CLI's
defaults. They install no signal handlers and change no process state, so they
run from any thread; every failure is a ``StreamckError``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from streamck.check import DiffResult
from streamck.check import diff as _diff
from streamck.errors import UsageError
from streamck.plan import (
    AUX_LAYER_PLANS,
    BUILTIN_PLANS,
    HF_CONFIG_PLANS,
    VERIFIER_PLANS,
    Plan,
    Rule,
    Rules,
    compile_plan,
    load_rules,
)
from streamck.plan.rules import rules_from
from streamck.source import Checkpoint, open_checkpoint
from streamck.source.layout import pick_step
from streamck.writer import WriteResult, write_plan
from streamck.writer.parts import parse_part

Source = str | os.PathLike | Checkpoint


def _checkpoint(
    source: Source, step: str | int | None = None, key: str | None = None, zero: bool = False, keep_tied: bool = False
) -> Checkpoint:
    return source if isinstance(source, Checkpoint) else open_checkpoint(source, step, key, zero, keep_tied)


def build_plan(
    source: Source,
    *,
    rules: Iterable[Rule | Mapping[str, str]] = (),
    plan: str | os.PathLike | None = None,
    dtype: str | None = None,
    casts: Mapping[str, str] | None = None,
    step: str | int | None = None,
    key: str | None = None,
    zero: bool = False,
    keep_tied: bool = False,
    copy_files: bool = True,
    verifier: str | None = None,
    aux_layer_ids: Sequence[int] | str | None = None,
    hf_config: str | os.PathLike | None = None,
    merge_lora: str | os.PathLike | None = None,
    safe_merge: bool = False,
    merge_lora_any_base: bool = False,
    merge_engine: str | None = None,
    experts: str = "auto",
) -> Plan:
    """Compile what ``rewrite`` would write, without writing: the output tensors, their
    sources and dtypes, and the side files. ``merge_lora`` names a PEFT LoRA adapter folder
    to merge in as PEFT's merge_and_unload does (``safe_merge`` as there; ``merge_lora_any_base``
    skips the check that it was trained on this base; ``merge_engine="numpy"`` merges without
    torch, not bit for bit), see streamck.plan.lora. ``experts`` is how MoE experts come out:
    ``"auto"`` as save_pretrained writes them (fused runtime tensors split per expert, the family
    from config.json), ``"keep"`` as the source has them, ``"fuse"`` fused as transformers runs
    them (see streamck.plan.moe).

    >>> p = build_plan("ckpt", rules=[{"strip_prefix": "model."}], dtype="bf16")  # doctest: +SKIP
    >>> [t.name for t in p.tensors][:2]  # doctest: +SKIP
    ['embed_tokens.weight', 'layers.0.mlp.up_proj.weight']
    """
    if merge_lora is not None and plan is not None and os.fspath(plan) in BUILTIN_PLANS:
        raise UsageError(f"--merge-lora merges into a base checkpoint, not into --plan {plan}")
    lora_flags = {"--safe-merge": safe_merge, "--merge-engine": merge_engine}
    lora_flags["--merge-lora-any-base"] = merge_lora_any_base
    stray = [flag for flag, value in lora_flags.items() if value not in (None, False)]
    if merge_lora is None and stray:
        raise UsageError(f"{', '.join(stray)} applies to --merge-lora only")
    extra = tuple(Rule("cast", f"{glob}={dt}") for glob, dt in (casts or {}).items())
    given = Rules(rules_from(rules) + extra, dtype)
    if plan is not None and os.fspath(plan) in BUILTIN_PLANS:
        if isinstance(source, Checkpoint):
            raise UsageError(f"plan {plan!r} opens its own source: pass a path, not a Checkpoint")
        if key is not None or zero or keep_tied:
            raise UsageError(f"--key, --zero and --keep-tied do not apply to --plan {plan}, which opens its own source")
        path = pick_step(Path(source), step) if step is not None else source
        extra = {"verifier": verifier} if verifier is not None else {}
        if extra and os.fspath(plan) not in VERIFIER_PLANS:
            raise UsageError(f"--verifier applies to --plan {', '.join(sorted(VERIFIER_PLANS))} only, not {plan}")
        if aux_layer_ids is not None:
            if os.fspath(plan) not in AUX_LAYER_PLANS:
                raise UsageError(f"--aux-layer-ids applies to --plan {', '.join(sorted(AUX_LAYER_PLANS))} only")
            extra["aux_layer_ids"] = aux_layer_ids
        if hf_config is not None:
            if os.fspath(plan) not in HF_CONFIG_PLANS:
                raise UsageError(f"--hf-config applies to --plan {', '.join(sorted(HF_CONFIG_PLANS))} only")
            extra["hf_config"] = hf_config
        return BUILTIN_PLANS[os.fspath(plan)](path, given, **extra)
    if verifier is not None:
        raise UsageError(f"--verifier applies to --plan {', '.join(sorted(VERIFIER_PLANS))} only")
    if aux_layer_ids is not None:
        raise UsageError(f"--aux-layer-ids applies to --plan {', '.join(sorted(AUX_LAYER_PLANS))} only")
    if hf_config is not None:
        raise UsageError(f"--hf-config applies to --plan {', '.join(sorted(HF_CONFIG_PLANS))} only")
    base = load_rules(plan) if plan is not None else Rules()
    compiled = compile_plan(_checkpoint(source, step, key, zero, keep_tied), base + given, copy_files=copy_files)
    compiled = _experts(compiled, experts)
    if merge_lora is None:
        return compiled
    return _merge_lora(compiled, merge_lora, safe_merge, merge_lora_any_base, merge_engine)


def _experts(plan: Plan, mode: str) -> Plan:
    from streamck.plan.moe import MODES, apply_experts

    if mode not in MODES:
        raise UsageError(f"experts={mode!r}: one of {', '.join(MODES)}")
    return apply_experts(plan, mode)


def _merge_lora(plan: Plan, adapter: str | os.PathLike, safe_merge: bool, any_base: bool, engine: str | None) -> Plan:
    """``plan`` with the adapter merged in: by torch (PEFT's bits) when it is installed, else
    by numpy (not bit for bit), which the plan's summary and notices say."""
    from streamck.plan.lora.plan import ENGINES, merge_lora

    if engine is not None and engine not in ENGINES:
        raise UsageError(f"--merge-engine {engine}: one of {', '.join(ENGINES)}")
    note = None
    if engine in (None, "torch"):
        try:
            import torch  # noqa: F401
        except ModuleNotFoundError:
            if engine == "torch":
                raise UsageError("--merge-engine torch: torch is not installed: pip install 'streamck[cast]'") from None
            note = "torch is not installed: merging with numpy, not bit for bit (see --merge-engine)"
    engine = engine or ("numpy" if note else "torch")
    merged = merge_lora(plan, adapter, safe_merge=safe_merge, any_base=any_base, engine=engine)
    if note:
        merged.notices.append(note)
    return merged


def rewrite(
    source: Source,
    output: str | os.PathLike,
    *,
    rules: Iterable[Rule | Mapping[str, str]] = (),
    plan: str | os.PathLike | None = None,
    dtype: str | None = None,
    casts: Mapping[str, str] | None = None,
    step: str | int | None = None,
    key: str | None = None,
    zero: bool = False,
    keep_tied: bool = False,
    copy_files: bool = True,
    max_shard_size: int | str | None = None,
    format: str | None = None,
    jobs: int = 1,
    part: tuple[int, int] | str | None = None,
    keep_shards: bool = False,
    header_align: int = 8,
    force: bool = False,
    verify: bool = False,
    device: str | None = None,
    drop_cache: bool = False,
    verifier: str | None = None,
    aux_layer_ids: Sequence[int] | str | None = None,
    hf_config: str | os.PathLike | None = None,
    merge_lora: str | os.PathLike | None = None,
    safe_merge: bool = False,
    merge_lora_any_base: bool = False,
    merge_engine: str | None = None,
    experts: str = "auto",
) -> WriteResult:
    """Rewrite the checkpoint at ``source`` into ``output``, like ``streamck rewrite``.

    ``rules`` take the plan file's shape (``{"strip_prefix": "model."}``, applied in
    order) or Rule objects; ``plan`` is a built-in plan name (``"eagle4"``) or a TOML
    plan file whose rules run first; ``dtype`` casts every float tensor and ``casts``
    maps globs to dtypes (winning over ``dtype``); ``max_shard_size`` is bytes or a
    size like ``"5GB"``; ``format="torch"`` writes torch.save archives (a ``.bin``/``.pt``/
    ``.pth`` output name does too); ``key``/``zero``/``keep_tied`` choose what a torch
    pickle, a DCP checkpoint (``key="model"``: the weights of a model + optimizer save)
    or a DeepSpeed checkpoint is read as (see open_checkpoint); ``verifier`` is the
    target model named in ``plan="eagle3-speculators"``'s config; ``aux_layer_ids``
    (``[1, 15, 28]`` or ``"1,15,28"``, Automodel's convention) overrides the target layers
    an ``eagle3`` plan's step records; ``hf_config`` is the Hugging Face config.json giving
    a trainer plan's model sizes (``plan="torchtitan-llama3"``, ``"megatron-gpt"``); ``experts``
    is how MoE experts are written (``"auto"``, ``"keep"``, ``"fuse"``: see build_plan); ``jobs``
    writes that many shards at once; ``part="K/N"`` writes only part K of N of the shards
    (see streamck.writer.parts); ``keep_shards`` writes one file per source file, tensors in
    the source's order, so that where the filesystem can share blocks (XFS reflink, btrfs) a
    rename shares them all (``result.shared`` bytes; see streamck.writer.clone).
    Memory stays near one chunk (per job).

    >>> import numpy as np, safetensors.numpy, tempfile, streamck
    >>> d = tempfile.mkdtemp()
    >>> safetensors.numpy.save_file({"model.w": np.ones((2, 3), np.float32)}, f"{d}/in.safetensors")
    >>> result = streamck.rewrite(f"{d}/in.safetensors", f"{d}/out.safetensors",
    ...                           rules=[{"strip_prefix": "model."}], dtype="bf16")
    >>> streamck.ls(f"{d}/out.safetensors")["tensors"]
    {'w': {'dtype': 'BF16', 'shape': [2, 3]}}
    """
    from streamck.writer import parse_size

    compiled = build_plan(
        source,
        rules=rules,
        plan=plan,
        dtype=dtype,
        casts=casts,
        step=step,
        key=key,
        zero=zero,
        keep_tied=keep_tied,
        copy_files=copy_files,
        verifier=verifier,
        aux_layer_ids=aux_layer_ids,
        hf_config=hf_config,
        merge_lora=merge_lora,
        safe_merge=safe_merge,
        merge_lora_any_base=merge_lora_any_base,
        merge_engine=merge_engine,
        experts=experts,
    )
    size = parse_size(max_shard_size) if isinstance(max_shard_size, str) else max_shard_size
    return write_plan(
        compiled,
        output,
        max_shard_size=size,
        header_align=header_align,
        force=force,
        verify=verify,
        device=device,
        drop_cache=drop_cache,
        format=format,
        jobs=jobs,
        part=parse_part(part) if isinstance(part, str) else part,
        keep_shards=keep_shards,
    )


def ls(
    source: Source,
    *,
    step: str | int | None = None,
    key: str | None = None,
    zero: bool = False,
    keep_tied: bool = False,
) -> dict[str, Any]:
    """The manifest of ``source`` (``streamck ls --json``): every tensor's dtype and shape,
    the metadata and the total size, from headers alone.

    >>> import numpy as np, safetensors.numpy, tempfile, streamck
    >>> d = tempfile.mkdtemp()
    >>> safetensors.numpy.save_file({"b": np.zeros(4, np.int8)}, f"{d}/m.safetensors")
    >>> streamck.ls(f"{d}/m.safetensors")["total_size"]
    4
    """
    from streamck.manifest import checkpoint_manifest

    return checkpoint_manifest(_checkpoint(source, step, key, zero, keep_tied))


def diff(
    a: str | os.PathLike,
    b: str | os.PathLike,
    *,
    ignore: Iterable[str] = (),
    data: bool = False,
    key: str | None = None,
    zero: bool | tuple[bool, bool] = False,
    keep_tied: bool = False,
) -> DiffResult:
    """Compare two checkpoints or manifests (``streamck diff``); ``bool(result)`` is True
    when they differ and ``str(result)`` is the report. ``key`` and ``keep_tied`` apply to
    both sides, as open_checkpoint takes them; ``zero`` too, or per side as ``(a, b)``
    (a ZeRO step against the model exported from it).

    >>> import numpy as np, safetensors.numpy, tempfile, streamck
    >>> d = tempfile.mkdtemp()
    >>> safetensors.numpy.save_file({"w": np.zeros(2, np.float32)}, f"{d}/a.safetensors")
    >>> safetensors.numpy.save_file({"w": np.ones(2, np.float32)}, f"{d}/b.safetensors")
    >>> streamck.diff(f"{d}/a.safetensors", f"{d}/b.safetensors").equal
    True
    >>> [x.differing for x in streamck.diff(f"{d}/a.safetensors", f"{d}/b.safetensors", data=True).data]
    [2]
    """
    from streamck.check.diff import load_side

    zero_a, zero_b = zero if isinstance(zero, tuple) else (zero, zero)
    sa = load_side(a, key=key, zero=zero_a, keep_tied=keep_tied)
    sb = load_side(b, key=key, zero=zero_b, keep_tied=keep_tied)
    return _diff(sa, sb, ignore=tuple(ignore), data=data)


def hash(
    source: Source,
    *,
    step: str | int | None = None,
    key: str | None = None,
    zero: bool = False,
    keep_tied: bool = False,
) -> dict[str, Any]:
    """The manifest of ``source`` with the sha256 of every tensor's bytes (``streamck hash
    --json``), read in bounded pieces.

    >>> import numpy as np, safetensors.numpy, tempfile, streamck
    >>> d = tempfile.mkdtemp()
    >>> safetensors.numpy.save_file({"w": np.zeros(1, np.int8)}, f"{d}/m.safetensors")
    >>> streamck.hash(f"{d}/m.safetensors")["tensors"]["w"]["sha256"][:12]
    '6e340b9cffb3'
    """
    from streamck.check.digest import hash_manifest

    return hash_manifest(_checkpoint(source, step, key, zero, keep_tied))


def export_eagle4_draft(
    checkpoint_dir: str | os.PathLike, output_dir: str | os.PathLike, *, dtype: str | None = None, force: bool = False
) -> Path:
    """Export the EAGLE-4 draft at ``checkpoint_dir`` (a step directory, its
    ``model/consolidated``, or a step holding only shards) into ``output_dir``
    (``config.json`` and ``model.safetensors``), casting floating tensors to ``dtype`` if
    given. Returns ``output_dir``. Raises PlanError or OutputError before writing anything.

    >>> streamck.export_eagle4_draft("runs/draft/epoch_0_step_3000", "exports/draft", dtype="bf16")  # doctest: +SKIP
    PosixPath('exports/draft')
    """
    output_dir = Path(output_dir)
    rewrite(checkpoint_dir, output_dir, plan="eagle4", dtype=dtype, force=force)
    return output_dir
