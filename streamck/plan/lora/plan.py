"""``--merge-lora``: a PEFT LoRA adapter merged into the plan's tensors, as PEFT 0.21.2's
``merge_and_unload`` merges it (peft/tuners/lora/layer.py, variants.py, dora.py).

The plan only says what each output tensor is: a base tensor with a ``LoraMerge`` attached
(computed block by block by streamck.transforms.lora), a ``modules_to_save`` copy from the
adapter in place of the base tensor, or the base tensor unchanged. Everything the merge
refuses is refused here, before a byte is written.

Adapter keys, as PEFT's save_pretrained writes them (the adapter name removed; an in-memory
state dict's ``.default`` is accepted too), each under ``base_model.model.``:

- ``<m>.lora_A.weight``, ``<m>.lora_B.weight`` (and ``lora_B.bias`` with ``lora_bias``);
- ``<m>.lora_embedding_A``, ``<m>.lora_embedding_B`` for an embedding;
- ``<m>.lora_magnitude_vector`` for DoRA;
- ``<m>.base_layer.weight``: the full copy PEFT saves of a targeted embedding, which loading
  puts in place of the base's (so the merge starts from it);
- any other ``<m>.<param>``: a ``modules_to_save`` copy (or a trained bias), which replaces
  the base tensor as is.
"""

from __future__ import annotations

import json
import re
from dataclasses import fields, replace
from pathlib import Path

from streamck.dtypes import CASTABLE
from streamck.errors import PlanError, listing
from streamck.plan.compile import OutputTensor, Plan
from streamck.plan.lora.config import LoraConfig, read_config, weights_file
from streamck.source import Checkpoint, TensorRef, open_checkpoint
from streamck.storage import location
from streamck.transforms.lora import LoraMerge
from streamck.transforms.lora_np import NumpyMerge
from streamck.transforms.lora_torch import TorchMerge

PREFIX = "base_model.model."
ENGINES = {
    "torch": "torch fp32 on the CPU, PEFT's bits",
    "numpy": "numpy fp32: not bit for bit, a few values may differ from PEFT's in their last bits",
}
# The transform that computes a merge, by engine.
MERGES: dict[str, type[LoraMerge]] = {"torch": TorchMerge, "numpy": NumpyMerge}
_PART = re.compile(
    r"(?P<module>.+?)\.(?P<part>lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector|base_layer)"
    r"(?:\.(?!weight$|bias$)(?P<adapter>[^.]+))?(?:\.(?P<param>weight|bias))?"
)
# A modules_to_save copy in its wrapper's names (an in-memory state dict, or beside a
# resized vocabulary, where PEFT also saves the base's module as ``original_module``).
_SAVED = re.compile(
    r"(?P<module>.+?)\.(?P<kind>modules_to_save|original_module)\.(?:(?P<adapter>[^.]+)\.)?(?P<param>[^.]+)"
)
HEAD = "lm_head.weight"
# The input embeddings a tied lm_head shares (transformers' names for them).
EMBEDDINGS = ("model.embed_tokens.weight", "transformer.wte.weight", "model.embed_in.weight", "embed_tokens.weight")


def merge_lora(
    plan: Plan, adapter: str | Path, *, safe_merge: bool = False, any_base: bool = False, engine: str = "torch"
) -> Plan:
    """``plan`` with the adapter at ``adapter`` (a folder holding adapter_config.json and
    adapter_model.safetensors) merged in. ``safe_merge`` is PEFT's: the delta rounded to the
    base dtype before the add, and a non-finite result an error. ``any_base`` skips the check
    that the adapter's ``base_model_name_or_path`` names this base. ``engine="numpy"`` computes
    without torch, not bit for bit (streamck.transforms.lora_np).
    Raises PlanError."""
    adapter = location(adapter)
    config = read_config(adapter)
    source = open_checkpoint(weights_file(adapter))
    base = plan.source
    if base is None:
        raise PlanError("{merge_lora} needs a plan read from a base checkpoint")
    if not any_base:
        _check_base_name(config, base)
    modules, copies, originals = _parse(source)
    base_config = _base_config(plan, base)
    tied = _tied(base, base_config)
    for name, ref in {**originals, **copies}.items():
        _check_resized(ref, base.tensors.get(tied if name == HEAD and tied else name), source.path)
    if config.ensure_weight_tying and tied:
        raise PlanError(
            "ensure_weight_tying is set and the base ties its embeddings: PEFT merges the delta into the shared "
            "tensor twice; refusing",
            config.path,
        )
    by_source = {t.source.name: i for i, t in enumerate(plan.tensors)}
    tensors = list(plan.tensors)
    merged = {}
    for module, parts in sorted(modules.items()):
        for name, new in _module_outputs(module, parts, config, base, tied, safe_merge, source.path):
            if name in merged:
                raise PlanError(f"the adapter changes {name} twice (both halves of a tied pair?)", source.path)
            merged[name] = new
    for name, ref in _placed_copies(copies, base, tied, source.path).items():
        if name in merged:
            raise PlanError(f"the adapter changes {name} twice (a LoRA and a saved copy of it)", source.path)
        merged[name] = ref
    untie = bool(tied) and any(name in (HEAD, tied) for name in copies)
    merged = {k: v if isinstance(v, TensorRef) else (v[0], _on(engine, v[1])) for k, v in merged.items()}
    for name, new in merged.items():
        i = by_source.get(name)
        if i is not None:  # else the rules dropped it
            tensors[i] = _replace(tensors[i], new, source.path, engine)
    side = dict(plan.side_files)
    if untie:
        _untie(plan, tensors, tied, copies, by_source, engine)
        if "config.json" in side:
            side["config.json"] = (json.dumps({**base_config, "tie_word_embeddings": False}, indent=2) + "\n").encode()
    summary = _summary(adapter, config, modules, copies, untie, engine)
    return replace(plan, tensors=tensors, summary=[*plan.summary, *summary], side_files=side)


def _placed_copies(copies: dict[str, TensorRef], base: Checkpoint, tied: str | None, where: Path) -> dict:
    """The saved copies that replace a base tensor; a tied lm_head's copy has none (see _untie)."""
    for name, ref in copies.items():
        if name not in base.tensors and not (name == HEAD and tied):
            raise PlanError(f"holds {ref.name}, which the base has no tensor {name} for", where)
    return {name: ref for name, ref in copies.items() if name in base.tensors}


Parts = dict[str, dict[str, TensorRef]]


def _parse(source: Checkpoint) -> tuple[Parts, dict[str, TensorRef], dict[str, TensorRef]]:
    """The adapter's tensors: LoRA parts by module; copies, and PEFT's copies of the base's
    own modules (``original_module``), by the base name they stand for."""
    modules: dict[str, dict[str, TensorRef]] = {}
    copies: dict[str, TensorRef] = {}
    originals: dict[str, TensorRef] = {}
    adapters = set()
    for key, ref in source.tensors.items():
        name = key.removeprefix(PREFIX)
        m = _PART.fullmatch(name)
        if m is not None:
            part = m["part"] + ("." + m["param"] if m["param"] == "bias" else "")
            modules.setdefault(m["module"], {})[part] = ref
            adapters.add(m["adapter"])
            continue
        m = _SAVED.fullmatch(name)
        if m is not None:
            adapters.add(m["adapter"])
            target = f"{m['module']}.{m['param']}"
            if m["kind"] == "original_module":  # the base's own module: checked, not written
                originals[target] = ref
            else:
                copies[target] = ref
        elif "." in name:
            copies[name] = ref
        else:
            raise PlanError(f"holds {key!r}, which is no LoRA, DoRA or saved-module tensor", source.path)
    adapters.discard(None)
    if len(adapters) > 1:
        raise PlanError(f"holds several adapters ({', '.join(sorted(adapters))}); save one at a time", source.path)
    bad = [k for k, ref in source.tensors.items() if ref.dtype not in CASTABLE]
    if bad:
        raise PlanError(f"holds tensors that are not floating point: {listing(bad)}", source.path)
    return modules, copies, originals


def _module_outputs(module, parts, config, base, tied, safe_merge, where):
    """(base tensor name, new source or (source, LoraMerge)) for one adapted module."""
    embedding = "lora_embedding_A" in parts
    a_key, b_key = ("lora_embedding_A", "lora_embedding_B") if embedding else ("lora_A", "lora_B")
    missing = [k for k in (a_key, b_key) if k not in parts]
    if missing:
        raise PlanError(f"{module}: {' and '.join(missing)} missing", where)
    name = f"{module}.weight"
    target = name if name in base.tensors else tied if (name == HEAD and tied) else None
    if target is None:
        raise PlanError(f"adapts {module}, which the base has no {name} for (an adapter for another base?)", where)
    w = parts.get("base_layer", base.tensors[target])
    a, b, r = parts[a_key], parts[b_key], config.rank(module)
    if len(w.shape) != 2 or w.dtype not in CASTABLE:
        raise PlanError(f"{module}: {target} is {w.dtype}{list(w.shape)}; LoRA merges into 2-D float weights", where)
    _check_shape(where, a, (r, None))
    _check_shape(where, b, (None, r))
    if embedding:
        transposed = True
        _check_rows(where, a, w)
        _check_shape(where, b, (w.shape[1], r))
    else:
        out, inp = b.shape[0], a.shape[1]
        transposed = config.fan_in_fan_out if out == inp else w.shape == (inp, out)
        want = (inp, out) if transposed else (out, inp)
        if w.shape != want:
            raise PlanError(
                f"{module}: lora_A/lora_B make {list(want)}, {target} is {list(w.shape)} "
                "(an adapter for another base?)",
                where,
            )
    if "base_layer" in parts and parts["base_layer"].shape != base.tensors[target].shape:
        raise PlanError(
            f"{module}: base_layer.weight is {list(w.shape)}, the base's {target} is "
            f"{list(base.tensors[target].shape)} (a resized vocabulary); refusing",
            where,
        )
    magnitude = parts.get("lora_magnitude_vector")
    if (magnitude is not None) != config.use_dora:
        has = "has" if magnitude is not None else "has no"
        raise PlanError(f"{module} {has} lora_magnitude_vector, and use_dora is {config.use_dora}", where)
    if magnitude is not None and transposed:
        raise PlanError(f"{module}: DoRA on an embedding or fan_in_fan_out layer is not supported", where)
    if magnitude is not None:
        _check_shape(where, magnitude, (w.shape[0],))
    scale = config.scaling(module)
    merge = LoraMerge("linear", b, a, scale, transposed, embedding or safe_merge, magnitude, safe_merge)
    yield target, (w, merge)
    bias = parts.get("lora_B.bias")
    if (bias is not None) != config.lora_bias:
        has = "has" if bias is not None else "has no"
        raise PlanError(f"{module}: lora_B {has} a bias, and lora_bias is {config.lora_bias}", where)
    if bias is not None:
        bias_name = f"{module}.bias"
        if bias_name not in base.tensors:
            raise PlanError(f"{module}: lora_B has a bias and the base has no {bias_name}", where)
        _check_shape(where, bias, base.tensors[bias_name].shape)
        yield bias_name, (base.tensors[bias_name], LoraMerge("bias", bias, None, scale, safe=safe_merge))


def _check_resized(ref: TensorRef, base: TensorRef | None, where: Path) -> None:
    """A saved copy must have its base tensor's shape: an embedding of other rows is a resized vocabulary."""
    if base is not None and ref.shape != base.shape:
        raise PlanError(
            f"{ref.name} is {list(ref.shape)}, the base's {base.name} {list(base.shape)}: a resized "
            "vocabulary (or another base) is not supported",
            where,
        )


def _check_shape(where: Path, ref: TensorRef, want) -> None:
    got = ref.shape
    if len(got) != len(want) or any(w is not None and g != w for g, w in zip(got, want, strict=True)):
        shown = ["*" if w is None else w for w in want]
        raise PlanError(f"{ref.name} is {list(got)}, expected {shown} (an adapter for another base?)", where)


def _check_rows(where: Path, a: TensorRef, w: TensorRef) -> None:
    if a.shape[1] != w.shape[0]:
        raise PlanError(
            f"{a.name} spans {a.shape[1]} tokens, the base's {w.name} {w.shape[0]}: a resized vocabulary "
            "is not supported",
            where,
        )


def _replace(t: OutputTensor, new, where: Path, engine: str) -> OutputTensor:
    """``t`` computed from ``new``: a copy's TensorRef, or (W, LoraMerge)."""
    ref, merge = (new, None) if isinstance(new, TensorRef) else new
    if merge is None and ref.shape != t.source.shape:
        raise PlanError(
            f"{ref.name} is {list(ref.shape)}, the base's {t.source.name} {list(t.source.shape)} "
            "(a resized vocabulary, or another base); refusing",
            where,
        )
    if merge is None:
        return _copy(t.name, t.source, ref, t.dtype, engine)
    return OutputTensor(t.name, ref, t.dtype, merge)


def _copy(name: str, base: TensorRef, ref: TensorRef, dtype: str, engine: str) -> OutputTensor:
    """A saved copy ``ref`` in place of ``base``, written in ``dtype`` (the base tensor's output
    dtype): PEFT loads the copy into the base's module, so it is rounded to the base's dtype
    first, and --dtype/--cast apply to that; a plain cast when one rounding is all it takes."""
    if ref.dtype == base.dtype or dtype == base.dtype:
        return OutputTensor(name, ref, dtype)
    return OutputTensor(name, base, dtype, MERGES[engine]("copy", ref))


def _tied(base: Checkpoint, config: dict) -> str | None:
    """The embedding the base's lm_head shares, when it ties them (no lm_head.weight of its
    own, and a config that does not say tie_word_embeddings: false)."""
    if HEAD in base.tensors or config.get("tie_word_embeddings", True) is False:
        return None
    return next((e for e in EMBEDDINGS if e in base.tensors), None)


def _base_config(plan: Plan, base: Checkpoint) -> dict:
    """The base's config.json as the output gets it (or as it lies, with copy_files off)."""
    data = plan.side_files.get("config.json", (base.side_root or base.root) / "config.json")
    try:
        loaded = json.loads(data if isinstance(data, bytes) else data.read_bytes())
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _untie(plan: Plan, tensors: list, embed: str, copies: dict, by_source: dict, engine: str) -> None:
    """A modules_to_save copy of one half of a tied pair unties them, as PEFT writes the merge:
    the other half gets the base's shared tensor under its own name, and the copied config
    says ``tie_word_embeddings: false``."""
    i = by_source.get(embed)
    shared = plan.source.tensors[embed]
    # Both halves are the one base tensor's module in PEFT: the head takes the embedding output's dtype.
    dtype = tensors[i].dtype if i is not None else shared.dtype
    tensors.append(_copy(HEAD, shared, copies.get(HEAD, shared), dtype, engine))
    tensors.sort(key=lambda t: t.name)


def _check_base_name(config: LoraConfig, base: Checkpoint) -> None:
    """The adapter's base_model_name_or_path must end in the base's folder (or repo) name."""
    recorded = (config.base_model_name_or_path or "").rstrip("/")
    if not recorded:
        return
    names = {base.root.name, base.path.name}
    for part in base.root.parts:
        if part.startswith("models--"):
            names.add(part.split("--")[-1])
    if recorded.split("/")[-1] not in names:
        raise PlanError(
            f"the adapter was trained on {recorded!r} (base_model_name_or_path), not {base.root.name}; "
            "pass {merge_lora_any_base} if it is the same model",
            config.path,
        )


def _summary(adapter: Path, config: LoraConfig, modules: dict, copies: dict, untie: bool, engine: str) -> list[str]:
    kind = "DoRA" if config.use_dora else "rsLoRA" if config.use_rslora else "LoRA"
    lines = [
        f"merging {kind} adapter {adapter}: {len(modules)} modules (r={config.r}, alpha={config.lora_alpha}), "
        + ENGINES[engine]
    ]
    if copies:
        lines.append(f"replaced by the adapter's saved copies: {listing(sorted(copies), 5)}")
    if untie:
        lines.append("lm_head and the input embeddings untied (tie_word_embeddings: false), as PEFT writes it")
    return lines


def _on(engine: str, merge: LoraMerge) -> LoraMerge:
    """``merge`` computed by ``engine``."""
    return MERGES[engine](*(getattr(merge, f.name) for f in fields(merge)))
