"""The GGUF tests' fixtures, kept in the fixture cache keyed by this file: llama.cpp's reference
converter and tiny models with their reference conversions.

- The reference: ``convert_hf_to_gguf.py`` with the gguf-py beside it, from the llama-cpp-python
  0.3.36 sdist (``pip download``, unpacked once into the fixture cache), run with this venv's
  torch and transformers in a child process.
- The models: a Llama 3 and a Qwen3 with 2 layers and random bf16 weights, built by
  bench/gguf_ckpt.py (shared with the bench's GGUF case): ``save_pretrained``, and a tokenizer
  from the vocabulary llama.cpp ships for its tokenizer tests, which the reference recognises
  (``llama-bpe``, ``qwen2``) by the same sha256 it recognises Meta-Llama-3 and Qwen by.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from fixture_cache import built_once, cache_dir, fixture_root

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import gguf_ckpt  # the builders, shared with the bench's GGUF case
from gguf_ckpt import LLAMA_CPP_PYTHON, fetch_llama_cpp


def llama_cpp() -> Path:
    """The vendored llama.cpp folder of the llama-cpp-python sdist, unpacked once per machine."""
    base = cache_dir() / f"llama-cpp-python-{LLAMA_CPP_PYTHON}"
    return built_once(base, fetch_llama_cpp) / "llama.cpp"


def make_model(kind: str, out: Path, seed: int = 0) -> None:
    """A tiny ``kind`` model (bench/gguf_ckpt.py's builder) with its tokenizer."""
    gguf_ckpt.make_model(kind, out, llama_cpp(), seed)


def tiny_model(tmp_path_factory, kind: str) -> Path:
    """The ``kind`` model's folder, built once per machine (keyed by its code and the packages)."""
    root = fixture_root(tmp_path_factory, f"gguf-{kind}", "tests/gguf_models.py", "bench/gguf_ckpt.py")
    return built_once(root / "model", lambda tmp: make_model(kind, tmp))


def reference_file(model: Path, outtype: str) -> Path:
    """The reference's GGUF of ``model`` (tiny_model's folder) as ``outtype``, kept beside it."""
    base = built_once(model.parent / f"reference-{outtype}", lambda tmp: reference(model, tmp / "model.gguf", outtype))
    return base / "model.gguf"


def reference(model: Path, out: Path, outtype: str, *extra: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """llama.cpp's ``convert_hf_to_gguf.py MODEL --outfile OUT --outtype OUTTYPE`` with its own
    gguf-py, in a child (this venv's torch and transformers), output captured."""
    script = llama_cpp() / "convert_hf_to_gguf.py"
    cmd = [sys.executable, str(script), str(model), "--outfile", str(out), "--outtype", outtype, *extra]
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def fused_model(tmp_path_factory, kind: str) -> Path:
    """``kind``'s tiny model as transformers 5 holds it in memory and a trainer saves it
    (``model.state_dict()``: ``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]),
    with its config and tokenizer, in a folder named ``model`` as tiny_model's is (the folder's
    name is ``general.name``)."""
    per_expert = tiny_model(tmp_path_factory, kind)

    def build(tmp: Path) -> None:
        import shutil

        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM

        for f in per_expert.iterdir():
            if f.name != "model.safetensors":
                shutil.copy(f, tmp / f.name)
        model = AutoModelForCausalLM.from_pretrained(per_expert, dtype=torch.bfloat16)
        state = {n: t.contiguous() for n, t in model.state_dict().items()}
        assert any(n.endswith("mlp.experts.gate_up_proj") for n in state), "not the fused layout"
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})

    return built_once(per_expert.parent / "fused" / "model", build)


def big_moe(out: Path, tokenizer_from: Path, experts: int, inter: int) -> Path:
    """bench/gguf_ckpt.py's one-layer Qwen3-MoE (``make_stacks``) in ``out``, its tokenizer copied
    from ``tokenizer_from`` (a tiny_model folder of the qwen3moe kind)."""
    gguf_ckpt.make_stacks(out, llama_cpp(), experts, inter, tokenizer_from)
    return out
