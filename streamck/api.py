"""One call per command: what the CLI does, as functions a program can import.

Each opens the source, compiles the plan and writes or reports, with the CLI's
defaults. They install no signal handlers and change no process state, so they
run from any thread; every failure is a ``StreamckError``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from streamck.check import DiffResult
from streamck.check import diff as _diff
from streamck.check.diff import Side
from streamck.errors import UsageError
from streamck.gcpause import paused
from streamck.plan import Plan, Rule, Rules
from streamck.plan.options import PlanOptions, split_options
from streamck.plan.rules import rules_from
from streamck.source import Checkpoint
from streamck.source.checkpoint import resolve_step
from streamck.spec import SourceSpec
from streamck.storage import location, requests_in_flight
from streamck.writer import WriteResult
from streamck.writer.options import WriteOptions

Source = str | os.PathLike | Checkpoint | SourceSpec


def build_plan(source: Source, options: PlanOptions | None = None, **keywords: Any) -> Plan:
    """Compile what ``rewrite`` would write, without writing: the output tensors, their
    sources and dtypes, and the side files. ``source`` is a path, a Checkpoint or a
    SourceSpec; ``options`` a PlanOptions (streamck.plan.options: rules, dtype, casts, LoRA
    merge, experts, quantization); ``keywords`` are SourceSpec's fields (``step``, ``key``,
    ``zero``, ``keep_tied``, ``plan``, ``hf_config``, ``verifier``, ``aux_layer_ids``) and
    PlanOptions' (``dtype="bf16"``, the older spelling) over what those say. The passes run
    in the order streamck.plan.passes.PASSES lists.

    ``merge_lora`` names a PEFT LoRA adapter folder to merge in as PEFT's merge_and_unload
    does (``merge_engine="numpy"`` merges without torch, not bit for bit), see
    streamck.plan.lora. ``experts`` is how MoE experts come out without a built-in plan:
    ``"auto"`` as save_pretrained writes them (fused runtime tensors split per expert, the
    family from config.json), ``"keep"`` as the source has them, ``"fuse"`` fused as
    transformers runs them (see streamck.plan.moe). ``quantize`` names a scheme
    (``"FP8_BLOCK"``) to quantize the output's linear weights to, as llm-compressor's
    model_free_ptq does, leaving out the modules ``quantize_ignore`` names besides the
    defaults; ``dtype`` on a quantized source dequantizes it (see streamck.plan.quant).

    >>> p = build_plan("ckpt", rules=[{"strip_prefix": "model."}], dtype="bf16")  # doctest: +SKIP
    >>> [t.name for t in p.tensors][:2]  # doctest: +SKIP
    ['embed_tokens.weight', 'layers.0.mlp.up_proj.weight']
    """
    read, changes = split_options(keywords, SourceSpec, PlanOptions)
    spec, o = SourceSpec.of(source, **read), PlanOptions.of(options, **changes)
    if o.merge_lora is not None and spec.builtin is not None:
        raise UsageError(f"{{merge_lora}} merges into a base checkpoint, not into {{plan}} {spec.builtin}")
    extra = tuple(Rule("cast", f"{glob}={dt}") for glob, dt in o.casts.items())
    plan_rules = Rules(rules_from(o.rules) + extra, o.dtype)
    from streamck.plan.passes import run_passes  # only here: ls and diff do not need them

    with requests_in_flight(spec.remote_concurrency):
        with paused():  # the per-tensor objects of the plan (see streamck.gcpause)
            compiled = spec.compile(plan_rules, copy_files=o.copy_files)
        return run_passes(compiled, plan_rules, o, builtin=spec.builtin)


def rewrite(
    source: Source,
    output: str | os.PathLike,
    *,
    plan_options: PlanOptions | None = None,
    write_options: WriteOptions | None = None,
    on_plan: Callable[[Plan], None] | None = None,
    **keywords: Any,
) -> WriteResult:
    """Rewrite the checkpoint at ``source`` into ``output``, like ``streamck rewrite``. Either
    may be a URL (``s3://bucket/key``, see streamck.storage): read by ranged requests, written
    as multipart uploads completed only at the end.

    Three objects say what happens, each checked where it is made: ``source`` may be a
    SourceSpec (what is read, and how: a run's step, a key, a built-in plan such as
    ``"eagle4"`` with its options); ``plan_options`` a PlanOptions (streamck.plan.options:
    rules, dtype, LoRA merge, experts, quantization); ``write_options`` a WriteOptions
    (streamck.writer.options: format, shard size, force, verify, strict, jobs, part,
    progress …). ``keywords`` are any of their fields over what those say, by name
    (``dtype="bf16"``, ``max_shard_size="5GB"``, ``plan="eagle4"``). ``on_plan`` is called
    with the compiled plan before a byte is written (the CLI prints its notices there).

    Memory stays near one chunk per job, whatever the tensor sizes.

    >>> import numpy as np, safetensors.numpy, tempfile, streamck
    >>> d = tempfile.mkdtemp()
    >>> safetensors.numpy.save_file({"model.w": np.ones((2, 3), np.float32)}, f"{d}/in.safetensors")
    >>> result = streamck.rewrite(f"{d}/in.safetensors", f"{d}/out.safetensors",
    ...                           rules=[{"strip_prefix": "model."}], dtype="bf16")
    >>> streamck.ls(f"{d}/out.safetensors")["tensors"]
    {'w': {'dtype': 'BF16', 'shape': [2, 3]}}
    """
    from streamck import writer
    from streamck.writer import formats

    read, changes, written = split_options(keywords, SourceSpec, PlanOptions, WriteOptions)
    write_options = WriteOptions.of(write_options, **written)  # its mistakes before the source is read
    spec, plan_options = SourceSpec.of(source, **read), PlanOptions.of(plan_options, **changes)
    fmt, _ = formats.choose(write_options.format, os.fspath(output))
    plan_options, write_options = formats.route_types(fmt, plan_options, write_options)  # GGUF's --outtype
    with requests_in_flight(spec.remote_concurrency):  # for the reads and the uploads alike
        compiled = build_plan(spec, plan_options)
        if on_plan is not None:
            on_plan(compiled)
        return writer.write_plan(compiled, output, write_options)


def manifest_of(spec: SourceSpec) -> tuple[dict[str, Any], Checkpoint | None, Plan | None]:
    """What ``spec`` reads as a manifest: its checkpoint's, or with a plan what the plan
    would write; and the checkpoint or the plan it came from."""
    from streamck.manifest import checkpoint_manifest, plan_manifest

    if spec.plan is None:
        ckpt = spec.open()
        return checkpoint_manifest(ckpt), ckpt, None
    plan = spec.compile()
    return plan_manifest(plan), None, plan


def ls(source: Source, **read: Any) -> dict[str, Any]:
    """The manifest of ``source`` (``streamck ls --json``): every tensor's dtype and shape,
    the metadata and the total size, from headers alone. ``read`` are SourceSpec's fields;
    with a ``plan``, the manifest of what the plan would write.

    >>> import numpy as np, safetensors.numpy, tempfile, streamck
    >>> d = tempfile.mkdtemp()
    >>> safetensors.numpy.save_file({"b": np.zeros(4, np.int8)}, f"{d}/m.safetensors")
    >>> streamck.ls(f"{d}/m.safetensors")["total_size"]
    4
    """
    spec = SourceSpec.of(source, **read)
    with requests_in_flight(spec.remote_concurrency):
        return manifest_of(spec)[0]


def diff(
    a: Source,
    b: Source,
    *,
    ignore: Iterable[str] = (),
    data: bool = False,
    zero: bool | tuple[bool, bool] = False,
    **read: Any,
) -> DiffResult:
    """Compare two checkpoints or manifests (``streamck diff``); ``bool(result)`` is True
    when they differ and ``str(result)`` is the report. ``read`` (SourceSpec's fields: ``key``,
    ``keep_tied``, ``step``, ``plan`` …) applies to both sides, or give each side as a
    SourceSpec; ``zero`` applies to both, or per side as ``(a, b)`` (a ZeRO step against the
    model exported from it). A side read through a plan is what the plan would write: names,
    dtypes and shapes (``data`` compares checkpoints only).

    >>> import numpy as np, safetensors.numpy, tempfile, streamck
    >>> d = tempfile.mkdtemp()
    >>> safetensors.numpy.save_file({"w": np.zeros(2, np.float32)}, f"{d}/a.safetensors")
    >>> safetensors.numpy.save_file({"w": np.ones(2, np.float32)}, f"{d}/b.safetensors")
    >>> streamck.diff(f"{d}/a.safetensors", f"{d}/b.safetensors").equal
    True
    >>> [x.differing for x in streamck.diff(f"{d}/a.safetensors", f"{d}/b.safetensors", data=True).data]
    [2]
    """
    zero_a, zero_b = zero if isinstance(zero, tuple) else (zero, zero)
    specs = [SourceSpec.of(x, zero=z, **read) for x, z in ((a, zero_a), (b, zero_b))]
    with requests_in_flight(read.get("remote_concurrency")):
        return _diff(*map(load_side, specs), ignore=tuple(ignore), data=data)


def load_side(spec: SourceSpec) -> Side:
    """One side of a diff: a manifest JSON file, a checkpoint, or what a plan would write."""
    from streamck.check.diff import load_side as load_checkpoint_side

    if spec.plan is None:
        if isinstance(spec.path, Checkpoint):
            from streamck.manifest import checkpoint_manifest

            return Side(str(spec.path.path), checkpoint_manifest(spec.path), spec.path)
        if spec.step is not None:
            spec = SourceSpec.of(resolve_step(location(spec.path), spec.step)[0], step=None)
        return load_checkpoint_side(spec.path, key=spec.key, zero=spec.zero, keep_tied=spec.keep_tied)
    manifest = manifest_of(spec)[0]
    return Side(f"{spec.path} (--plan {os.fspath(spec.plan)})", manifest)


def hash(source: Source, **read: Any) -> dict[str, Any]:
    """The manifest of ``source`` with the sha256 of every tensor's bytes (``streamck hash
    --json``), read in bounded pieces. ``read`` are SourceSpec's fields; with a ``plan``, the
    digests of the bytes the plan would write (computed as a rewrite computes them).

    >>> import numpy as np, safetensors.numpy, tempfile, streamck
    >>> d = tempfile.mkdtemp()
    >>> safetensors.numpy.save_file({"w": np.zeros(1, np.int8)}, f"{d}/m.safetensors")
    >>> streamck.hash(f"{d}/m.safetensors")["tensors"]["w"]["sha256"][:12]
    '6e340b9cffb3'
    """
    from streamck.check.digest import hash_manifest

    spec = SourceSpec.of(source, **read)
    with requests_in_flight(spec.remote_concurrency):
        if spec.plan is None:
            return hash_manifest(spec.open())
        from streamck.writer import plan_digests

        return plan_digests(spec.compile())


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
