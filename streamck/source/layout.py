"""Which files of a checkpoint hold its weights, for every layout streamck reads."""

from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

import orjson

from streamck.errors import CheckpointError, listing
from streamck.source.steps import LATEST_LINK, LATEST_NAME, LATEST_NUMBER, steps
from streamck.storage import UrlPath

# Index files, most preferred first; each names shards relative to its directory.
INDEX_NAMES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# Weight files found without an index. Trainer folders also hold optimizer.pt,
# scheduler.pt, rng_state*.pth and training_args.bin: never weights, never matched.
SHARD_GLOBS = ("*.safetensors", "pytorch_model*.bin")
CONSOLIDATED = Path("model", "consolidated")
# Distributed checkpoints: torch DCP's sharded safetensors (one per rank) and native DCP.
DCP_SHARDS = "shard-*-model-*-of-*.safetensors"
DCP_METADATA = ".metadata"
# Automodel: a step being written holds this file; the model's side files live here.
INCOMPLETE = ".incomplete"
HF_METADATA = Path("model", ".hf_metadata")
# Automodel writes .hf_metadata (config, tokenizer) for safetensors saves only.
NO_HF_METADATA = (
    "no config.json in this Automodel step (model_save_format: torch_save saves none): put the model's "
    "config.json and tokenizer in its model/ folder and rewrite again, for an output from_pretrained opens"
)
# What a directory output leaves behind of the source directory: weights (streamck writes
# its own), their indexes, and training state, which no loader reads. Everything else
# (config, every tokenizer file, custom code, README) goes along.
NOT_SIDE_FILES = (
    "*.safetensors",
    "*.bin",
    "*.pt",
    "*.pth",
    "*.ckpt*",
    "*.h5",
    "*.msgpack",
    "*.gguf",
    "*.onnx",
    "*.onnx_data",
    "*.distcp",
    "*.index.json",
    "shard-*",
    "optimizer*",
    "scheduler.pt",
    "rng_state*",
    "random_states*",
    "trainer_state.json",
    "zero_to_fp32.py",
    "zero_to_torch.py",  # DeepSpeed 0.19 copies both recovery scripts; this one imports the other
    "latest",
    "LATEST",
    "LATEST.txt",
    "fqn_to_file_index_mapping.json",
    "events.out.tfevents*",
)
# sentence-transformers lists its module folders (``1_Pooling/``) here; they go along whole.
ST_MODULES = "modules.json"
# A repo id read from the local Hugging Face cache: ``org/name``.
REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


@dataclass(frozen=True)
class Layout:
    """The weights of a checkpoint: ``root`` directory and shard files; with an index,
    its tensor → shard map as written and, per shard file, the names it is written as.

    ``kind`` says how the shards are read: ``files`` (safetensors or torch zips, each
    tensor whole in one file), ``dcp`` (torch DCP sharded safetensors), ``distcp``
    (native DCP), ``fsdp`` (accelerate's SHARDED_STATE_DICT: native DCP of ``{"model": ...}``)
    or ``zero`` (DeepSpeed ZeRO state, ``root`` its ``global_stepN``).
    ``side_root`` holds the config and tokenizer files; ``zero`` is set when ZeRO state
    sits beside a weights file (a Trainer ``checkpoint-N/``), for the index to choose, and
    ``zero_unclear`` says why it is not when that is a guess (several step folders, no
    ``latest``), raised only if the ZeRO state is needed. ``notes`` are said when it is read.
    """

    root: Path
    shards: list[Path]
    weight_map: dict[str, str] | None = None
    spellings: dict[Path, set[str]] | None = None
    index: Path | None = None
    kind: str = "files"
    side_root: Path | None = None
    zero: Path | None = None
    zero_unclear: CheckpointError | None = None
    notes: tuple[str, ...] = ()  # notices the index starts with (what a trainer's folder leaves out)


def _load_index(index_path: Path) -> dict[str, str]:
    try:
        obj = orjson.loads(index_path.read_bytes())
    except orjson.JSONDecodeError as e:
        raise CheckpointError(f"not valid JSON ({e})", index_path) from None
    weight_map = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(weight_map, dict) or set(map(type, weight_map.values())) - {str}:
        raise CheckpointError("has no 'weight_map' object of tensor name to shard file", index_path)
    return weight_map


def _shard_path(root: Path, name: str, index_path: Path) -> Path:
    rel = Path(name)
    if rel.is_absolute() or ".." in rel.parts or not rel.parts:
        raise CheckpointError(f"shard path {name!r} escapes the checkpoint directory", index_path)
    if escapes(root / rel, root):
        raise CheckpointError(f"shard {name!r} is a link out of the checkpoint directory: not followed", index_path)
    return root / rel


def _home(root: Path) -> Path:
    """What a checkpoint at ``root`` may link within: itself, or for a Hugging Face cache
    snapshot the whole cache entry (its files are links to ``../../blobs/``)."""
    real = root.resolve()
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        return real.parent.parent
    return real


def escapes(path: Path, root: Path) -> bool:
    """Whether ``path`` in the checkpoint at ``root`` is, or lies under, a link that leads out of
    it (a README.md linked to /proc/self/environ would copy the process's secrets into the
    output), or one that leads nowhere. A URL has no links."""
    if isinstance(path, UrlPath):
        return False
    try:
        target = path.resolve(strict=True)
    except FileNotFoundError:  # a missing file is the caller's to name; a link to nothing is not followed
        return path.is_symlink()
    except (OSError, RuntimeError):  # a loop of links
        return True
    return not target.is_relative_to(_home(root))


def from_index(root: Path, index_path: Path) -> Layout:
    weight_map = _load_index(index_path)
    spellings: dict[Path, set[str]] = {}
    for shard in set(weight_map.values()):
        path = _shard_path(root, shard, index_path)
        if not path.is_file():
            raise CheckpointError(f"weight_map names shard {shard!r}, which does not exist", index_path)
        spellings.setdefault(path, set()).add(shard)
    return Layout(root, sorted(spellings), weight_map, spellings, index_path)


_NUMBERED = re.compile(r"(.+)-(\d{5})-of-(\d{5})(\.safetensors|\.bin)")


def incomplete(path: Path, shards: list[Path]) -> CheckpointError | None:
    """The error for numbered shards without an index that are not all there
    (``model-00002-of-00004.safetensors`` but no ``-00001-``): an output whose ``--part`` runs
    have not all finished, or a copy cut short, which would read as a smaller model."""
    sets: dict[tuple[str, int, str], set[int]] = {}
    for shard in shards:
        m = _NUMBERED.fullmatch(shard.name)
        if m:
            sets.setdefault((m.group(1), int(m.group(3)), m.group(4)), set()).add(int(m.group(2)))
    for (stem, total, suffix), have in sorted(sets.items()):
        missing = [f"{stem}-{i:05d}-of-{total:05d}{suffix}" for i in range(1, total + 1) if i not in have]
        if missing:
            return CheckpointError(
                f"incomplete: {len(missing)} of {total} shards missing ({listing(missing, 4)}) and no index; "
                "an output whose {part} runs have not all finished?",
                path,
            )
    return None


def bare_run_root(path: Path) -> bool:
    """Whether ``path`` is a run root that records its latest step and holds no weights of
    its own, so that it is read at that step when no ``--step`` is given."""
    if not path.is_dir() or not any((path / n).exists() for n in (LATEST_LINK, LATEST_NAME, LATEST_NUMBER)):
        return False
    weights = (*INDEX_NAMES, DCP_METADATA)
    if any((path / n).is_file() for n in weights) or any(next(path.glob(g), None) for g in (*SHARD_GLOBS, "*.distcp")):
        return False
    return bool(steps(path))


def _distributed(path: Path) -> Layout | None:
    """A torch DCP checkpoint in ``path`` (native, or sharded safetensors), or None."""
    distcp = sorted(path.glob("*.distcp"))
    if distcp or (path / DCP_METADATA).is_file() or any(path.glob("__*.metadata")):  # per-rank: use_collectives=False
        return Layout(path, distcp, kind="distcp")
    shards = sorted(p for p in path.glob(DCP_SHARDS) if p.is_file())
    if shards:
        return Layout(path, shards, kind="dcp")
    return None


def _fsdp(path: Path) -> Layout | None:
    """accelerate's SHARDED_STATE_DICT model folder in a Trainer ``checkpoint-N/`` (or given
    itself), read as the model; side files from ``checkpoint-N/``. None when there is none."""
    from streamck.source.dcp.fsdp import model_dir

    found = model_dir(path)
    if found is None:
        return None
    return Layout(found, sorted(found.glob("*.distcp")), kind="fsdp", side_root=found.parent)


def _olmo(path: Path) -> Layout | None:
    """An OLMo-core step folder: its ``model_and_optim/`` DCP, side files from the step."""
    from streamck.source.dcp.olmo import model_dir

    found = model_dir(path)
    return None if found is None else Layout(found, sorted(found.glob("*.distcp")), kind="distcp", side_root=path)


def _automodel_step(path: Path) -> Layout | None:
    """An Automodel step folder: ``model/consolidated`` when it is there, else the shards
    in ``model/`` consolidated on the fly; side files from ``model/.hf_metadata``, and a note
    when there is none (a torch_save step)."""
    if (path / INCOMPLETE).exists():
        raise CheckpointError(f"this step is still being written (it holds {INCOMPLETE}); pick a finished one", path)
    if (path / CONSOLIDATED).is_dir() and any((path / CONSOLIDATED).iterdir()):
        return find_layout(path / CONSOLIDATED)
    found = _distributed(path / "model") if (path / "model").is_dir() else None
    if found is None:
        return None
    side = path / HF_METADATA
    if side.is_dir():
        return Layout(found.root, found.shards, kind=found.kind, side_root=side)
    notes = () if (found.root / "config.json").is_file() else (NO_HF_METADATA,)
    return Layout(found.root, found.shards, kind=found.kind, side_root=found.root, notes=notes)


def side_files(root: Path, linked_out: list[str] | None = None) -> dict[str, Path]:
    """What a directory output copies from ``root``, by name: every file that is not a weight,
    an index or training state (NOT_SIDE_FILES) nor hidden (temporaries, DCP's ``.metadata``),
    since loaders need files no list foresees (tokenizers, custom code); and the module
    folders a sentence-transformers ``modules.json`` names. Other folders stay behind: in a
    training directory they are steps and optimizer state. A link out of the checkpoint
    (escapes) is never followed: its name goes to ``linked_out`` instead."""
    found = {p.name: p for p in sorted(root.iterdir()) if p.is_file() and not _left_behind(p.name)}
    found |= {d.name: d for d in _st_modules(root)}
    links = [n for n, p in found.items() if p.is_symlink() and escapes(p, root)]
    if linked_out is not None:
        linked_out.extend(links)
    return {n: p for n, p in found.items() if n not in links}


def _left_behind(name: str) -> bool:
    return name.startswith(".") or any(fnmatch.fnmatchcase(name, g) for g in NOT_SIDE_FILES)


def _st_modules(root: Path) -> list[Path]:
    """The module folders of a sentence-transformers model (``1_Pooling/``); none if unreadable."""
    try:
        modules = orjson.loads((root / ST_MODULES).read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return []
    paths = [m.get("path") for m in modules if isinstance(m, dict)] if isinstance(modules, list) else []
    return [
        root / rel
        for rel in paths
        if isinstance(rel, str) and rel not in ("", ".", "..") and "/" not in rel and (root / rel).is_dir()
    ]


def joins_shards(directory: Path, name: str) -> bool:
    """Whether a file ``name`` written into the checkpoint directory ``directory`` would be read
    as one of its shards from then on (no index there says which files are), so that the
    source would no longer open, or would open as something else."""
    if any((directory / n).is_file() for n in INDEX_NAMES):
        return False
    return any(fnmatch.fnmatchcase(name, g) for g in (*SHARD_GLOBS, DCP_SHARDS, "*.distcp"))


def hub_cache() -> Path:
    """Where huggingface_hub keeps downloads: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
    ``~/.cache/huggingface/hub`` (under ``XDG_CACHE_HOME`` when set, as huggingface_hub does)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home, "hub").expanduser()


def hub_snapshot(path: Path) -> Path:
    """``path`` itself; or for a Hugging Face cache entry (``models--org--name``), or a repo id
    (``org/name`` that is no path here) found in the local cache, the snapshot ``refs/main``
    names. Never the network: a repo id that is not cached is an error saying so."""
    if isinstance(path, UrlPath):
        return path
    if not path.exists() and REPO_ID.match(path.as_posix()):
        cached = hub_cache() / ("models--" + path.as_posix().replace("/", "--"))
        if not cached.is_dir():
            raise CheckpointError(
                f"no such path, nor a repo in the Hugging Face cache {hub_cache()} "
                f"(streamck never downloads: run `hf download {path}` first)",
                path,
            )
        path = cached
    snapshots = path / "snapshots"
    if not (path.name.startswith("models--") and snapshots.is_dir()):
        return path
    ref = path / "refs" / "main"
    if ref.is_file():
        commit = ref.read_text().strip()
        if not (commit not in ("", "..") and Path(commit).name == commit and (snapshots / commit).is_dir()):
            raise CheckpointError(f"refs/main names snapshot {commit!r}, which is not in snapshots/", path)
        return snapshots / commit
    found = sorted(p.name for p in snapshots.iterdir() if p.is_dir())
    if len(found) != 1:
        raise CheckpointError(f"no refs/main, and {len(found)} snapshots: give snapshots/<commit> itself", path)
    return snapshots / found[0]


def find_layout(path: Path) -> Layout:
    """Find the weights for any supported layout, or say what was looked for."""
    path = hub_snapshot(path)
    from streamck.source.dcp import fsdp
    from streamck.source.verl import fsdp as verl
    from streamck.source.verl import megatron as verl_megatron
    from streamck.source.zero.find import find_zero, rank_file_error

    if path.is_file():
        if path.name in INDEX_NAMES:
            return find_layout(path.parent)
        refused = rank_file_error(path) or fsdp.rank_file_error(path) or verl.rank_file_error(path)
        if refused:
            raise refused
        return Layout(path.parent, [path])
    if not path.is_dir():
        raise CheckpointError("no such file or directory" + (" (or bucket)" if isinstance(path, UrlPath) else ""), path)
    try:
        zero, unclear = find_zero(path), None
    except CheckpointError as e:
        zero, unclear = None, e
    for name in INDEX_NAMES:
        if (path / name).is_file():
            return replace(from_index(path, path / name), zero=zero, zero_unclear=unclear)
    found = _fsdp(path)
    if found is not None:
        return found
    actor = verl.actor_dir(path)
    if actor is not None:  # a verl actor's rank files (or global_step_N/ holding actor/)
        return Layout(actor, [], kind="verl", side_root=actor / verl.HF_DIR)
    found = _olmo(path)
    if found is not None:
        return found
    found = _distributed(path)
    if found is not None:
        side = path / HF_METADATA.name  # the model/ folder of an Automodel step
        return Layout(found.root, found.shards, kind=found.kind, side_root=side) if side.is_dir() else found
    for pattern in SHARD_GLOBS:
        shards = sorted(p for p in path.glob(pattern) if p.is_file())
        if shards:
            refused = fsdp.rank_files_error(path) or incomplete(path, shards)
            if refused:
                raise refused
            return Layout(path, shards, zero=zero, zero_unclear=unclear)
    if zero is not None:
        # global_stepN/ given itself: Trainer's config and tokenizer are in checkpoint-N/ above
        side = path.parent if zero == path and (path.parent / "config.json").is_file() else path
        return Layout(zero, [], kind="zero", side_root=side)
    if unclear is not None:
        raise unclear
    step = _automodel_step(path) if (path / "model").is_dir() else None
    if step is not None:
        return step
    found = verl_megatron.hf_weights(path)
    if found is not None:  # a verl Megatron actor saved as verl does by default: the bridge's HF weights
        actor, hf = found
        inner = find_layout(hf)
        return replace(inner, notes=(*inner.notes, verl_megatron.left_beside(actor, f"{hf.relative_to(actor)}/")))
    found = steps(path)
    if found:
        listed = ", ".join(map(str, found))
        pick = "pick one with {step} N or {step} latest"
        raise CheckpointError(f"a training run root with steps {listed}: {pick}", path)
    raise no_weights(path)


# torch.save files a folder may hold, each readable when given itself (a folder of them is not
# one checkpoint: they may be a model, its EMA, a step each); training state is none of them.
TORCH_FILES = ("*.pt", "*.pth", "*.bin", "*.ckpt")
TRAINING_STATE = ("optimizer*", "scheduler*", "rng_state*", "random_states*", "training_args.bin")


def no_weights(path: Path) -> CheckpointError:
    """The error for a folder holding no weights streamck finds by itself: what was looked for,
    and the torch files here that it reads when given one (``streamck ls DIR/model.pt``)."""
    looked = f"no weights here (looked for {', '.join(INDEX_NAMES + SHARD_GLOBS)})"
    names = sorted({p.name for g in TORCH_FILES for p in path.glob(g) if p.is_file()})
    names = [n for n in names if not any(fnmatch.fnmatchcase(n, g) for g in TRAINING_STATE)]
    if not names:
        return CheckpointError(looked, path)
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return CheckpointError(f"{looked}; torch files here, each read when given itself: {shown}", path)
