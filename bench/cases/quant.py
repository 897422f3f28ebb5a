"""--quantize FP8_BLOCK / NVFP4A16 against llm-compressor's model_free_ptq, outputs compared, and the
arithmetic's floor on this machine (bench/quant_floor.py)."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
from pathlib import Path

from harness import HERE, PY, case, contend, cp_fsync, dir_bytes, mib, parse_size, run_child, streamck, table


@case
def case_quant(a: argparse.Namespace, tmp: Path) -> str:
    """bf16 Llama (in shards, and as one file) -> FP8_BLOCK and NVFP4A16: llm-compressor's
    model_free_ptq vs streamck --quantize vs cp -r of the base."""
    size = parse_size(a.size)
    sharded, one = tmp / "sharded", tmp / "one"
    subprocess.run([PY, str(HERE / "lora_ckpt.py"), "base", str(sharded), str(size)], check=True)
    subprocess.run(streamck("rewrite", str(sharded), "-o", str(one), "-q"), check=True)  # one model.safetensors
    out, sections = tmp / "out", []
    for scheme in a.schemes.split(","):
        for label, base in (("in shards", sharded), ("one file", one)):
            runs, verdict = _quant_runs(a, base, scheme, out)
            shards = len(list(base.glob("*.safetensors")))
            sections.append(
                f"{scheme}, base {label} ({shards} file{'s' if shards > 1 else ''}): outputs {verdict} (every "
                f"tensor under `diff --data`, and config.json byte for byte).\n\n"
                + table(runs, "cp -r + sync (base)", dir_bytes(base))
            )
        floor = subprocess.run([PY, str(HERE / "quant_floor.py"), str(sharded), scheme], check=True,
                               capture_output=True, text=True)  # fmt: skip
        f = json.loads(floor.stdout)
        sections.append(
            f"{scheme} floor on this machine (bench/quant_floor.py: the same arithmetic on the weights in "
            f"memory, no file read or written): {f['arithmetic']:.2f} s; a single `.to(float8_e4m3fn)` pass "
            f"over them {f['one_cast']:.2f} s."
        )
    _, torch_rss = run_child([PY, "-c", "import torch"], a.settle)
    return (
        f"Base: bf16 Llama by bench/lora_ckpt.py, {dir_bytes(sharded) / 2**30:.2f} GiB (hidden 1024, MLP 2816, "
        f"vocab 32000), with the default ignore list (lm_head, model.embed_tokens, re:.*mlp.gate$). "
        f"{a.reps} interleaved reps, {a.settle:.0f} s settle. "
        f"`python -c 'import torch'` alone peaks at {mib(torch_rss)}.\n\n" + "\n\n".join(sections)
    )


def _quant_runs(a: argparse.Namespace, base: Path, scheme: str, out: Path) -> tuple[dict, str]:
    """One scheme on one base: the three contenders interleaved, then both outputs compared once."""
    # streamck's default ignore list on this base (the head, the embeddings, a MoE router)
    ptq, ignore = str(HERE / "quant_ckpt.py"), ("lm_head", "model.embed_tokens", "re:.*mlp.gate$")
    ours = f"streamck --quantize {scheme}"
    contenders = {
        "cp -r + sync (base)": cp_fsync(base),
        f"model_free_ptq {scheme}": lambda o: [PY, ptq, "ptq", str(base), str(o), scheme, *ignore],
        ours: lambda o: streamck("rewrite", str(base), "-o", str(o), "--quantize", scheme, "-q"),
    }
    runs = contend(contenders, out, a.reps, a.settle, (base,))
    subprocess.run([PY, ptq, "ptq", str(base), str(out / "p"), scheme, *ignore], check=True)
    subprocess.run(contenders[ours](out / "s"), check=True)
    same = subprocess.run(streamck("diff", str(out / "s"), str(out / "p"), "--data", "-q"), capture_output=True)
    config = (out / "s" / "config.json").read_bytes() == (out / "p" / "config.json").read_bytes()
    shutil.rmtree(out)
    return runs, "equal" if same.returncode == 0 and config else "NOT equal"
