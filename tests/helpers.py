"""Small checkpoints built in temp dirs, with the reference writer or byte by byte."""

from __future__ import annotations

import json
import os
import shlex
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
from fixture_cache import built_once, fixture_root
from safetensors import safe_open
from safetensors.numpy import save_file

REPO = Path(__file__).resolve().parents[1]


def cli(*args, check: int | None = None, text: bool = True, cwd=None, env=None, **kw) -> subprocess.CompletedProcess:
    """``python -m streamck ARGS`` with this checkout's package, in a child, output captured
    (bytes with ``text=False``); with ``check``, its exit status is asserted."""
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    cmd = [sys.executable, "-m", "streamck", *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=text, cwd=cwd, env=env, **kw)
    if check is not None:
        assert proc.returncode == check, proc.stderr
    return proc


def run_bench(*args: str, env: dict[str, str], timeout: int = 900) -> subprocess.CompletedProcess:
    """``bench/run.py ARGS`` in a session of its own, output captured; on ``timeout`` the whole
    process group (its torchrun ranks too) is killed and the test fails, instead of waiting on a
    hung rank for ever."""
    import signal

    cmd = [sys.executable, str(REPO / "bench" / "run.py"), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"bench/run.py {' '.join(args)}: no end after {timeout} s\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def save(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=metadata if metadata is not None else {"format": "pt"})
    return path


def save_sharded(directory: Path, tensors: dict[str, np.ndarray], n: int, index: bool = True) -> Path:
    """Split ``tensors`` round-robin over ``n`` shards, with a weight_map index if ``index``."""
    directory.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    weight_map = {}
    for i in range(n):
        shard = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        part = {k: tensors[k] for k in names[i::n]}
        save(directory / shard, part)
        weight_map.update(dict.fromkeys(part, shard))
    if index:
        (directory / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map})
        )
    return directory


def write_step(root: Path, config: dict, tensors: dict, *, consolidated: bool = False, shards: int = 0) -> Path:
    """A training step as the trainer saves it: ``config.json``, a generation config and the
    tensors (one file, or ``shards`` with an index), in ``root`` or its ``model/consolidated``."""
    directory = root / "model" / "consolidated" if consolidated else root
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "generation_config.json").write_text("{}")
    if shards:
        save_sharded(directory, tensors, shards)
    else:
        save(directory / "model.safetensors", tensors)
    return root


def raw_bytes(header: dict | bytes, data: bytes = b"", length: int | None = None) -> bytes:
    """A safetensors file's bytes from a header (dict, or raw JSON bytes) and data, by hand:
    ``length`` overrides the 8-byte header length."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def raw_file(path: Path, header: dict | bytes, data: bytes = b"", length: int | None = None) -> Path:
    """raw_bytes written to ``path``."""
    path.write_bytes(raw_bytes(header, data, length))
    return path


def llama_like(layers: int = 2, hidden: int = 8, vocab: int = 16, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    t = {
        "model.embed_tokens.weight": rng.standard_normal((vocab, hidden), dtype=np.float32),
        "model.norm.weight": rng.standard_normal(hidden, dtype=np.float32).astype(np.float16),
        "lm_head.weight": rng.standard_normal((vocab, hidden), dtype=np.float32),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = rng.standard_normal((hidden, hidden), dtype=np.float32)
        t[p + "mlp.up_proj.weight"] = rng.standard_normal((2 * hidden, hidden), dtype=np.float32)
        t[p + "input_layernorm.weight"] = rng.standard_normal(hidden, dtype=np.float32)
        t[p + "self_attn.rotary_emb.inv_freq"] = rng.standard_normal(hidden // 2, dtype=np.float32)
        t[p + "step"] = np.arange(3, dtype=np.int64)
    return t


def read_all(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a file or sharded directory, through the reference reader."""
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    out = {}
    for f in files:
        with safe_open(str(f), "np") as r:
            for k in r.keys():
                assert k not in out, k
                out[k] = r.get_tensor(k)
    return out


def metadata_of(path: Path) -> dict[str, str] | None:
    with safe_open(str(path), "np") as r:
        return r.metadata()


def says_the_plan(source: Path, plan: str, *plan_options) -> None:
    """Issue #36: a trainer's checkpoint that a built-in plan exports, rewritten without it,
    gets a note naming that plan (-q keeps it: it asks for action), and ``ls``'s summary
    names it too; with the plan given (and ``plan_options``), no such note."""
    hint = f"--plan {plan}"
    bare = cli("rewrite", source, "--dry-run", "-q", check=0)
    notes = [line for line in bare.stderr.splitlines() if line.startswith("streamck: note: this looks like")]
    assert len(notes) == 1 and hint in notes[0], bare.stderr
    listed = cli("ls", source, check=0).stdout.splitlines()[-1]
    assert listed.startswith("this looks like") and hint in listed, listed
    assert hint in cli("ls", source, "-q", "--json", check=0).stderr
    planned = cli("rewrite", source, "--dry-run", "--plan", plan, *plan_options, check=0)
    assert "this looks like" not in planned.stderr + planned.stdout


def missing(what: str) -> None:
    """A producer the test needs is not installed: a skip where someone runs pytest by hand,
    a failure under scripts/test (STREAMCK_REQUIRE_PRODUCERS), which installs every producer,
    so that a broken install never passes as skipped tests."""
    import pytest

    if os.environ.get("STREAMCK_REQUIRE_PRODUCERS"):
        pytest.fail(f"{what} (STREAMCK_REQUIRE_PRODUCERS: scripts/test installs it)")
    pytest.skip(what)


MEGATRON = os.environ.get("STREAMCK_MEGATRON_PATH", str(REPO / ".venv" / "megatron-core-0.19.2"))


def megatron_checkpoints(
    request, tmp_path_factory, script: str, what: str, torchrun: bool | int = False
) -> dict[str, Path]:
    """The checkpoints tests/``script`` writes with megatron-core's own code (and the stand-ins and steps of
    bench/megatron_ckpt.py and megatron_loop.py) into a folder per model, made once per version of that
    code and of the installed packages (fixture_cache: kept on the machine); megatron-core is put on the
    child's path only. Skipped where it is not unpacked (scripts/test does it). ``torchrun``: the script is
    one rank of 2 (of ``torchrun`` when a number), else it starts its own."""
    import pytest

    here = REPO / "tests"
    shared = [REPO / "bench" / name for name in ("megatron_ckpt.py", "megatron_loop.py", "standins.py")]
    base = fixture_root(tmp_path_factory, what, here / script, *shared) / what
    if not (base / "done").exists() and not Path(MEGATRON, "megatron", "core").is_dir():
        pytest.skip(f"megatron-core 0.19.2 is not unpacked at {MEGATRON} (scripts/test does it)")

    def build(tmp: Path) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([MEGATRON, os.environ.get("PYTHONPATH", "")])}  # fmt: skip
        world = str(2 if torchrun is True else torchrun)
        ranks = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", world] if torchrun else []
        command = ["timeout", "1200", sys.executable, *ranks, str(here / script), str(tmp)]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1300)
        if done.returncode:
            raise RuntimeError(f"{script} failed:\n{done.stderr[-6000:]}")

    built_once(base, build)
    return {d.name: d for d in base.iterdir() if d.is_dir()}


def script_checkpoints(
    tmp_path_factory, what: str, script: Path, *code: Path, env: dict | None = None
) -> dict[str, Path]:
    """The folders ``python SCRIPT DIR`` writes into DIR (the producer's own code, in a child with
    ``env`` added), by name: made once per version of ``script``, ``code`` and the installed
    packages, kept on the machine (fixture_cache)."""
    base = fixture_root(tmp_path_factory, what, script, *code) / what

    def build(tmp: Path) -> None:
        child = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        done = subprocess.run([sys.executable, str(script), str(tmp)], env=child,
                              capture_output=True, text=True, timeout=1200)  # fmt: skip
        if done.returncode:
            raise RuntimeError(f"{script.name} failed:\n{done.stderr[-6000:]}")

    built_once(base, build)
    return {d.name: d for d in base.iterdir() if d.is_dir()}


def titan_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """The runs bench/titan_ckpt.py writes with torchtitan 0.3.0's own CheckpointManager, by model."""
    bench = REPO / "bench"
    return script_checkpoints(tmp_path_factory, "titan", bench / "titan_ckpt.py", bench / "standins.py")


def fake_checkout(tmp: Path, *files: str) -> Path:
    """A copy of ``files`` (a script and what it runs) beside a .venv whose python and streamck
    are this checkout's and the suite's interpreter: the script's ``pip install`` must not
    repoint the suite's own venv, so pip is a no-op there."""
    root = tmp / "checkout"
    for name in files:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text((REPO / name).read_text())
    venv = root / ".venv" / "bin"
    venv.mkdir(parents=True)
    run = f"PYTHONPATH={shlex.quote(str(REPO))} exec {shlex.quote(sys.executable)}"
    (venv / "python").write_text(f'#!/bin/sh\n[ "$1 $2" = "-m pip" ] && exit 0\n{run} "$@"\n')
    (venv / "streamck").write_text(f'#!/bin/sh\n{run} -m streamck "$@"\n')
    for name in ("python", "streamck"):
        (venv / name).chmod(0o755)
    return root
