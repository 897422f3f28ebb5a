"""--merge-lora (LoRA and DoRA adapters by PEFT) against PEFT's merge_and_unload + save_pretrained."""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path

from harness import (
    HERE,
    PY,
    case,
    chart,
    contend,
    cp_fsync,
    dir_bytes,
    mib,
    parse_size,
    peak_at,
    run_child,
    streamck,
    table,
    version_of,
)


def _lora_inputs(tmp: Path, size: int, kinds: tuple[str, ...] = ("lora", "dora")) -> tuple[Path, ...]:
    """A bf16 Llama base of ``size`` bytes and PEFT adapters on every linear (LoRA, DoRA; r=16)."""
    make = [PY, str(HERE / "lora_ckpt.py")]
    base = tmp / f"base-{size}"
    subprocess.run([*make, "base", str(base), str(size)], check=True)
    for kind in kinds:
        flags = ["--dora"] if kind == "dora" else []
        subprocess.run(
            [*make, "adapter", str(base), str(tmp / f"{kind}-{size}"), *flags], check=True, capture_output=True
        )
    return base, *(tmp / f"{kind}-{size}" for kind in kinds)


@case(size="1GiB")
def case_lora(a: argparse.Namespace, tmp: Path) -> str:
    """--merge-lora (LoRA and DoRA on every linear, r=16) vs PEFT's merge_and_unload route vs cp -r of the base."""
    size = parse_size(a.size)
    base, lora, dora = _lora_inputs(tmp, size)
    data = dir_bytes(base)
    peft = str(HERE / "lora_ckpt.py")
    contenders = {
        "cp -r + sync (base)": cp_fsync(base),
        "PEFT merge_and_unload + save_pretrained (LoRA)": lambda o: [PY, peft, "peft", str(base), str(lora), str(o)],
        "streamck --merge-lora (LoRA)": lambda o: streamck(
            "rewrite", str(base), "-o", str(o), "--merge-lora", str(lora), "-q"
        ),
        "streamck --merge-lora --merge-engine numpy (LoRA)": lambda o: streamck(
            "rewrite", str(base), "-o", str(o), "--merge-lora", str(lora), "--merge-engine", "numpy", "-q"
        ),
        "PEFT merge_and_unload + save_pretrained (DoRA)": lambda o: [PY, peft, "peft", str(base), str(dora), str(o)],
        "streamck --merge-lora (DoRA)": lambda o: streamck(
            "rewrite", str(base), "-o", str(o), "--merge-lora", str(dora), "-q"
        ),
    }
    out = tmp / "out"
    runs = contend(contenders, out, a.reps, a.settle, (base, lora, dora))
    exact = []
    for kind, adapter in (("LoRA", lora), ("DoRA", dora)):  # the outputs themselves, once more, bit for bit
        subprocess.run(
            streamck("rewrite", str(base), "-o", str(out / "s"), "--merge-lora", str(adapter), "-q"), check=True
        )
        subprocess.run([PY, peft, "peft", str(base), str(adapter), str(out / "p")], check=True, capture_output=True)
        same = subprocess.run([PY, peft, "same", str(out / "s"), str(out / "p")]).returncode == 0
        exact.append(f"{kind} {'bit-identical to' if same else 'DIFFERS from'} PEFT's")
        shutil.rmtree(out)
    small, s_lora = _lora_inputs(tmp, size // 4, ("lora",))
    rss = peak_at(streamck("rewrite", str(small), "-o", str(out), "--merge-lora", str(s_lora), "-q"), out, a.settle)
    small_bytes, shards = dir_bytes(small), len(list(base.glob("*.safetensors")))
    shutil.rmtree(small)  # room for the 4x base
    shutil.rmtree(base)
    big, b_lora = _lora_inputs(tmp, size * 4, ("lora",))  # torch's import is paid once: the ratio at 4x
    large = {
        "cp -r + sync (base)": cp_fsync(big),
        "streamck --merge-lora (LoRA)": lambda o: streamck(
            "rewrite", str(big), "-o", str(o), "--merge-lora", str(b_lora), "-q"
        ),
    }
    large["streamck --merge-lora --merge-engine numpy (LoRA)"] = lambda o: streamck(
        "rewrite", str(big), "-o", str(o), "--merge-lora", str(b_lora), "--merge-engine", "numpy", "-q"
    )
    big_runs = contend(large, out, a.reps, a.settle, (big, b_lora))
    _, torch_rss = run_child([PY, "-c", "import torch"], a.settle)
    return (
        f"Base: bf16 Llama, {data / 2**30:.2f} GiB in {shards} shards (hidden 1024, "
        f"MLP 2816, vocab 32000); adapters by PEFT {version_of('peft')} on every linear, r=16. "
        f"{a.reps} interleaved reps, {a.settle:.0f} s settle. Outputs: {'; '.join(exact)} output.\n\n"
        + table(runs, "cp -r + sync (base)", data)
        + f"\n\nThe same at {dir_bytes(big) / 2**30:.2f} GiB (streamck and cp only):\n\n"
        + table(big_runs, "cp -r + sync (base)", dir_bytes(big))
        + f"\n\nstreamck peak RSS as the base grows (LoRA): {mib(rss)} at {small_bytes / 2**30:.2f} GiB, "
        f"{mib(runs['streamck --merge-lora (LoRA)'].peak)} at {data / 2**30:.2f} GiB, "
        f"{mib(big_runs['streamck --merge-lora (LoRA)'].peak)} at {dir_bytes(big) / 2**30:.2f} GiB; "
        f"`python -c 'import torch'` alone peaks at {mib(torch_rss)}."
        + chart(a, runs, "lora", f"merging a LoRA adapter into a {data / 2**30:.1f} GiB base: RSS over time")
    )
