"""-o model.gguf against llama.cpp's own converter (convert_hf_to_gguf.py, llama-cpp-python
0.3.36's copy) and cp -r of the model: bf16 and Q8_0, time and peak RSS, the files compared; and
the header's floor (_floor: what any writer that takes the vocabulary through gguf-py and
tokenizers does before its first tensor byte, then cp -r)."""

from __future__ import annotations

import argparse
import filecmp
import subprocess
from pathlib import Path

from harness import HERE, PY, case, contend, cp_fsync, dir_bytes, parse_size, run_child, streamck, table

CACHE = Path.home() / ".cache" / "streamck-bench"
# The least a gguf-py writer does for the header: start Python, import gguf-py and tokenizers, load
# the tokenizer (the reference's pre-tokenizer check encodes with it; its vocabulary comes from it)
# and parse tokenizer.json once (its merges); no keys packed, nothing written.
_HEADER_FLOOR = (
    "import sys, gguf, orjson; from tokenizers import Tokenizer; p = sys.argv[1] + '/tokenizer.json'; "
    "Tokenizer.from_file(p); orjson.loads(open(p, 'rb').read())"
)


def _floor(base: Path):
    """The header's floor (_HEADER_FLOOR), then cp -r + sync of the model, as one contender."""
    return lambda o: ["sh", "-c", f'"$0" -c "$1" "{base}" && cp -r "{base}" "{o}" && sync "{o}"/*', PY, _HEADER_FLOOR]


def _llama_cpp() -> Path:
    """The reference, fetched once per machine into the bench's cache."""
    from gguf_ckpt import LLAMA_CPP_PYTHON, fetch_llama_cpp

    where = CACHE / f"llama-cpp-python-{LLAMA_CPP_PYTHON}"
    if not (where / "llama.cpp" / "convert_hf_to_gguf.py").exists():
        where.mkdir(parents=True, exist_ok=True)
        fetch_llama_cpp(where)
    return where / "llama.cpp"


# bench/gguf_ckpt.py's Llama at hidden 2048: its embedding and head, and each layer, in bf16 bytes
EMBED_BYTES, LAYER_BYTES = 2 * 128256 * 2048 * 2, 94_380_032
REFERENCE_UP_TO = 2 << 30  # --size past which the reference is not run (its time and memory grow with it)


@case(size="1GiB")
def case_gguf(a: argparse.Namespace, tmp: Path) -> str:
    """A bf16 Llama 3 (its embeddings and head 525 MB each; 2 layers at 1GiB, more at a larger
    --size) to GGUF bf16 and Q8_0: streamck vs the reference, both against cp -r + sync of the
    model. Past 2 GiB the reference is left out (its figures at 1 GiB stand)."""
    llama_cpp, base = _llama_cpp(), tmp / "llama3"
    size = parse_size(a.size)
    layers = max(2, round((size - EMBED_BYTES) / LAYER_BYTES))
    cmd = [PY, str(HERE / "gguf_ckpt.py"), str(llama_cpp), "llama", str(base), "2048", str(layers)]
    subprocess.run(cmd, check=True)
    ref = str(llama_cpp / "convert_hf_to_gguf.py")

    # each contender writes OUT/model.gguf (OUT made first): contend removes OUT after each run
    def ours(*flags: str):
        return lambda o: ["sh", "-c", f'mkdir -p "{o}" && exec "$@"', "sh", *streamck("rewrite", str(base), "-o",
                          f"{o}/model.gguf", "-q", *flags)]  # fmt: skip

    def theirs(outtype: str):
        return lambda o: ["sh", "-c", f'mkdir -p "{o}" && exec "$@"', "sh", PY, ref, str(base), "--outfile",
                          f"{o}/model.gguf", "--outtype", outtype]  # fmt: skip

    contenders = {
        "cp -r + sync (model)": cp_fsync(base),
        "floor: header + cp": _floor(base),
        "streamck bf16": ours(),
        "convert_hf_to_gguf bf16": theirs("bf16"),
        "streamck Q8_0": ours("--quantize", "Q8_0"),
        "convert_hf_to_gguf q8_0": theirs("q8_0"),
    }
    pairs = (("bf16", "streamck bf16", "convert_hf_to_gguf bf16"), ("Q8_0", "streamck Q8_0", "convert_hf_to_gguf q8_0"))
    if size > REFERENCE_UP_TO:
        contenders = {k: v for k, v in contenders.items() if not k.startswith("convert_hf_to_gguf")}
        pairs = ()
    out = tmp / "out"
    runs = contend(contenders, out, a.reps, a.settle, (base,))
    verdicts = [] if pairs else ["the reference not run at this size"]
    for kind, *pair in pairs:
        files = []
        for label in pair:
            run_child(contenders[label](tmp / label.replace(" ", "-")), 0)
            files.append(tmp / label.replace(" ", "-") / "model.gguf")
        verdicts.append(f"{kind}: {'byte for byte equal' if filecmp.cmp(*files, shallow=False) else 'NOT equal'}")
    return (
        f"Model: bench/gguf_ckpt.py's Llama 3 (hidden 2048, {layers} layers, vocab 128256, untied head), "
        f"{dir_bytes(base) / 2**30:.2f} GiB bf16; its tokenizer from llama.cpp's llama-bpe test vocabulary. "
        f"{a.reps} interleaved reps, {a.settle:.0f} s settle. Files: {'; '.join(verdicts)}.\n\n"
        + table(runs, "cp -r + sync (model)", dir_bytes(base))
    )


@case(size="1GiB")
def case_gguf_moe(a: argparse.Namespace, tmp: Path) -> str:
    """A Qwen3-MoE layer of 16 experts of 16 MiB each (three stacked tensors of 256.06 MiB) to GGUF
    bf16 and Q8_0: streamck (one expert slice at a time) vs the reference (each stack whole)."""
    llama_cpp, base = _llama_cpp(), tmp / "qwen3moe"
    inter = 16 * 2**20 // 128 + 32  # an expert slice: inter x 64 bf16 values, 16 MiB
    subprocess.run([PY, str(HERE / "gguf_ckpt.py"), str(llama_cpp), "stacks", str(base), "16", str(inter)], check=True)
    ref = str(llama_cpp / "convert_hf_to_gguf.py")

    def ours(*flags: str):
        return lambda o: ["sh", "-c", f'mkdir -p "{o}" && exec "$@"', "sh", *streamck("rewrite", str(base), "-o",
                          f"{o}/model.gguf", "-q", *flags)]  # fmt: skip

    def theirs(outtype: str):
        return lambda o: ["sh", "-c", f'mkdir -p "{o}" && exec "$@"', "sh", PY, ref, str(base), "--outfile",
                          f"{o}/model.gguf", "--outtype", outtype]  # fmt: skip

    contenders = {
        "cp -r + sync (model)": cp_fsync(base),
        "floor: header + cp": _floor(base),
        "streamck bf16": ours(),
        "convert_hf_to_gguf bf16": theirs("bf16"),
        "streamck Q8_0": ours("--quantize", "Q8_0"),
        "convert_hf_to_gguf q8_0": theirs("q8_0"),
    }
    runs = contend(contenders, tmp / "out", a.reps, a.settle, (base,))
    verdicts = []
    for kind, *pair in (("bf16", "streamck bf16", "convert_hf_to_gguf bf16"),
                        ("Q8_0", "streamck Q8_0", "convert_hf_to_gguf q8_0")):  # fmt: skip
        files = []
        for label in pair:
            run_child(contenders[label](tmp / label.replace(" ", "-")), 0)
            files.append(tmp / label.replace(" ", "-") / "model.gguf")
        verdicts.append(f"{kind}: {'byte for byte equal' if filecmp.cmp(*files, shallow=False) else 'NOT equal'}")
        for f in files:
            f.unlink()
    return (
        f"Model: bench/gguf_ckpt.py's `stacks` Qwen3-MoE (one layer, hidden 64, 16 experts of {inter} rows: "
        f"gate, up and down each a stacked tensor of {16 * inter * 128 / 2**20:.1f} MiB), "
        f"{dir_bytes(base) / 2**30:.2f} GiB bf16; its tokenizer from llama.cpp's qwen2 test vocabulary. "
        f"{a.reps} interleaved reps, {a.settle:.0f} s settle. Files: {'; '.join(verdicts)}.\n\n"
        + table(runs, "cp -r + sync (model)", dir_bytes(base))
    )
