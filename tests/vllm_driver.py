"""Loads outputs in vLLM one after another, in ONE process (run inside the vLLM venv: tests/vllm_env.py):

    vllm_driver.py JOBS.json RESULTS.json

Each job is ``{"name", "model", "prompts", "max_tokens"}`` with optional ``"draft"`` (an EAGLE-3 draft,
run as vLLM's ``eagle3`` speculative method, ``"spec_tokens"`` tokens a step) and ``"logprobs"`` (top-k
reported, default 5). Each model is loaded with ``LLM(model, enforce_eager=True, max_model_len=256)``
in the checkpoint's dtype, no tokenizer (the prompts are token ids), its engine in this process (unless
``STREAMCK_VLLM_ENGINE=processes``), torn down after each job, and asked for greedy tokens with
the prompt's and each step's top log-probabilities. A job's result: ``tokens`` (per prompt),
``logprobs`` (per prompt, per step: [[id, logprob], ...]), ``prompt_logprobs`` (likewise, for prompt
positions 1..), the spec-decode counters from vLLM's metrics (``spec``), the lines of vLLM's log
(its engine's processes included) that mention skipped, missing, uninitialised or recast weights
(``weight_lines``), or ``error``: the last lines of the log where vLLM refused or failed. Each job's
whole log is ``JOB.log`` beside RESULTS.json.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

# What vLLM says of weights it did not take as they are: its loaders' "Skipping loading ..." / "not
# initialized from checkpoint" / "not loaded" / "Attempted to load weight ... with dtype ..." (cast
# to the parameter's) and the like, about weights, parameters, tensors or keys.
WEIGHT_WORDS = re.compile(
    r"skip|missing|not initiali[sz]ed|uninitiali[sz]ed|not loaded|unexpected|ignor|attempted to load", re.I
)
ABOUT_WEIGHTS = re.compile(r"weight|param|tensor|key|checkpoint|loading", re.I)
# vLLM's echo of its own settings (skip_tokenizer_init, ignore_patterns …), not a word about a weight
SETTINGS = re.compile(r"with config: |non-default args: ")
# "uni": the worker in this process; "mp" (STREAMCK_VLLM_ENGINE=processes, tests/vllm_env.py) vLLM's default
BACKEND = "mp" if os.environ.get("STREAMCK_VLLM_ENGINE") == "processes" else "uni"
START = time.monotonic()


@contextlib.contextmanager
def log_to(path: Path):
    """fds 1 and 2 (this process's and every child's it starts meanwhile: vLLM's EngineCore) to ``path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "w") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def top(entries) -> list[list]:
    """A step's top log-probabilities, as [[token id, logprob], ...] by rank."""
    return [[int(t), float(lp.logprob)] for t, lp in sorted(entries.items(), key=lambda kv: kv[1].rank)]


def spec_counters(llm) -> dict:
    """vLLM's spec-decode counters (drafts, draft tokens, accepted tokens) from its metrics."""
    out = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode_num_") and hasattr(metric, "value"):
            out[metric.name.removeprefix("vllm:spec_decode_")] = metric.value
    return out


def generate(llm, job: dict) -> dict:
    """Greedy tokens for ``job``'s prompts, with the prompt's and each step's top log-probabilities."""
    from vllm import SamplingParams

    k = job.get("logprobs", 5)
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], logprobs=k, prompt_logprobs=k,
                            detokenize=False, ignore_eos=True)  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], params, use_tqdm=False)
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "logprobs": [[top(step) for step in o.outputs[0].logprobs] for o in outs],
        "prompt_logprobs": [[top(step) for step in o.prompt_logprobs[1:]] for o in outs],
        "dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch."),
        "spec": spec_counters(llm) if job.get("draft") else {},
    }


def run_job(job: dict) -> dict:
    """Load ``job["model"]`` in vLLM, generate greedily, and shut the engine down."""
    from vllm import LLM
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    kw = {}
    if job.get("draft"):
        kw["speculative_config"] = {"method": "eagle3", "model": job["draft"],
                                    "num_speculative_tokens": job.get("spec_tokens", 2)}  # fmt: skip
    llm = None
    try:
        llm = LLM(model=job["model"], enforce_eager=True, max_model_len=256, dtype="auto", skip_tokenizer_init=True,
                  disable_log_stats=False, seed=0, distributed_executor_backend=BACKEND, **kw)  # fmt: skip
        print(f"== loaded {time.monotonic() - START:.1f}", flush=True)
        return generate(llm, job)
    finally:
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            del llm
        # The engine runs in this process (no EngineCore or worker of its own: ~25 s a load less on
        # 2 cores), so its parallel state outlives it, a refused load's too, and the next load would
        # reuse it: a dense model's has no expert group, which gpt-oss's loader asks for. Torn down.
        cleanup_dist_env_and_memory()


def weight_lines(log: str) -> list[str]:
    """The lines of ``log`` that say a weight was skipped, missing or left uninitialised."""
    lines = (line for line in log.splitlines() if not SETTINGS.search(line))
    return [line for line in lines if WEIGHT_WORDS.search(line) and ABOUT_WEIGHTS.search(line)]


def main(jobs_path: str, results_path: str) -> None:
    jobs = json.loads(Path(jobs_path).read_text())
    where = Path(results_path).parent
    results = {}
    for job in jobs:
        log = where / f"{job['name']}.log"
        with log_to(log):
            try:
                result = run_job(job)
            except Exception:  # a refusal is a result: the test says which are expected
                traceback.print_exc()
                result = {"error": None}
        text = log.read_text(errors="replace")
        if "error" in result:
            result["error"] = "\n".join(text.strip().splitlines()[-12:])
        result["weight_lines"] = weight_lines(text)
        results[job["name"]] = result
        print(job["name"], "error" if "error" in result else "ok", flush=True)
        Path(results_path).write_text(json.dumps(results))


def end_with_parent() -> None:
    """End this process group (vLLM's engine processes with it) once the test that started it
    (``STREAMCK_VLLM_PARENT``, else the parent now) is gone without ending it (pytest killed, CI
    cancelled): the parent is then someone else."""
    parent = int(os.environ.get("STREAMCK_VLLM_PARENT") or os.getppid())

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()


if __name__ == "__main__":
    end_with_parent()
    main(*sys.argv[1:])
