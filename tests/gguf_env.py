"""What the GGUF tests run beside their fixtures (tests/gguf_models.py): streamck's GGUF writer,
llama.cpp itself (the ``xllamacpp`` wheel, CPU, in a venv of its own kept in the fixture cache;
tests/gguf_llama.py runs inside it), transformers for the logits to compare, and a GGUF parser.
"""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
from pathlib import Path

from fixture_cache import built_once, cache_dir

REPO = Path(__file__).resolve().parents[1]
XLLAMACPP = "2026.10.11549"


def xllamacpp_python() -> Path:
    """The python of a venv holding the xllamacpp wheel (llama.cpp, CPU), made once per machine."""
    base = cache_dir() / f"venv-xllamacpp-{XLLAMACPP}"

    def build(tmp: Path) -> None:
        subprocess.run([sys.executable, "-m", "venv", str(tmp)], check=True, timeout=300)
        pip = [str(tmp / "bin" / "python"), "-m", "pip", "install", "-q", f"xllamacpp=={XLLAMACPP}"]
        subprocess.run(pip, check=True, capture_output=True, timeout=900)

    return built_once(base, build) / "bin" / "python"


def write_gguf(src: Path, out: Path, outtype: str = "auto", max_size: int | None = None) -> list[Path]:
    """streamck's GGUF of ``src`` at ``out``, written as a user asks for it (streamck.rewrite, the
    engine, a local destination): ``--outtype`` spelt as streamck's options (``--dtype``, or
    ``--quantize Q8_0``). Returns the files."""
    import streamck

    types = {"auto": {}, "q8_0": {"quantize": "Q8_0"}}.get(outtype, {"dtype": outtype})
    return streamck.rewrite(src, out, max_shard_size=max_size, **types).files


_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class _Cursor:
    """Little-endian GGUF fields read one after another from ``data``."""

    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def scalar(self, fmt: str):
        value = struct.unpack_from("<" + fmt, self.data, self.pos)[0]
        self.pos += struct.calcsize("<" + fmt)
        return value

    def string(self) -> bytes:
        n = self.scalar("Q")
        self.pos += n
        return self.data[self.pos - n : self.pos]

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, n = self.scalar("I"), self.scalar("Q")
            return (item, tuple(self.value(item) for _ in range(n)))
        return self.scalar(_SCALARS[kind])


def contents(path: Path, limit: int = -1) -> tuple[list, list, dict[str, bytes]]:
    """A GGUF file's key-value pairs (key, value type, value) in order, its tensor infos (name,
    shape, GGML type, offset) in order, and each tensor's bytes: parsed here by the format's
    spec (gguf-py's GGUFReader takes ~10 s on a 128k-token vocabulary), sizes from gguf-py.
    With ``limit``, only the file's first ``limit`` bytes are read (the tensors' bytes cut short)."""
    import gguf

    with open(path, "rb") as f:
        data = f.read(limit)
    cur = _Cursor(data)
    assert cur.data[:4] == b"GGUF" and struct.unpack_from("<I", data, 4)[0] == 3
    cur.pos = 8
    n_tensors, n_kv = cur.scalar("Q"), cur.scalar("Q")
    kvs = []
    for _ in range(n_kv):
        key, kind = cur.string().decode(), cur.scalar("I")
        kvs.append((key, kind, cur.value(kind)))
    infos = []
    for _ in range(n_tensors):
        name = cur.string().decode()
        shape = [cur.scalar("Q") for _ in range(cur.scalar("I"))]
        infos.append((name, shape, gguf.GGMLQuantizationType(cur.scalar("I")).name, cur.scalar("Q")))
    align = dict((k, v) for k, _, v in kvs).get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
    start = -(-cur.pos // align) * align
    tensors = {}
    for name, shape, kind, offset in infos:
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
        n = math.prod(shape) // block * size
        tensors[name] = data[start + offset : start + offset + n]
    return kvs, infos, tensors


def run_llama_cpp(model: Path | list[Path], prompt: list[int], n_predict: int = 8, n_probs: int = 5) -> dict | list:
    """llama.cpp's greedy continuation of ``prompt`` with the top log-probabilities of each step
    (tests/gguf_llama.py in the xllamacpp venv); for a list of models, a list of those, all run
    in one child."""
    arg = json.dumps([str(m) for m in model]) if isinstance(model, list) else str(model)
    cmd = [str(xllamacpp_python()), str(REPO / "tests" / "gguf_llama.py"), arg, json.dumps(prompt),
           str(n_predict), str(n_probs)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def logprob_deltas(model_dir: Path, prompt: list[int], run: dict) -> tuple[float, int]:
    """The largest |log p| difference between llama.cpp's ``run`` and transformers (float32, the
    same tokens), over every step's reported ids, and the steps whose greedy token agrees."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + run["tokens"]])).logits[0]
    logprobs = torch.log_softmax(logits, -1)
    worst, agree = 0.0, 0
    for i, (token, top) in enumerate(zip(run["tokens"], run["top"], strict=True)):
        row = logprobs[len(prompt) - 1 + i]
        agree += int(row.argmax()) == token
        worst = max([worst, *(abs(float(row[t]) - lp) for t, lp in top)])
    return worst, agree
