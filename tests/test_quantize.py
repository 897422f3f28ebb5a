"""--quantize against llm-compressor 0.14.0.1's model_free_ptq run here (tests/quant_oracles.py):
the same tensor names, dtypes, shapes and bytes, and the same config.json bytes, on a tiny Llama
(one file and sharded, widths no multiple of 128, a zero tile) and a per-expert Qwen3-MoE; the
refusals; memory bounded by a band of rows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import cli, save
from quant_fixtures import PTQ_CASES, quant  # noqa: F401  (a session fixture)
from safetensors import safe_open

pytest.importorskip("torch")


def tensors(folder: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """Every tensor of a folder's safetensors files: (dtype, shape, bytes) by name."""
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
            data = f.read()
        for name, info in header.items():
            if name != "__metadata__":
                start, end = info["data_offsets"]
                out[name] = (info["dtype"], info["shape"], data[start:end])
    return out


def assert_same_as_ptq(ours: Path, theirs: Path) -> None:
    a, b = tensors(ours), tensors(theirs)
    assert sorted(a) == sorted(b)
    differ = [n for n in a if a[n] != b[n]]
    assert not differ, f"{len(differ)} of {len(a)} tensors differ: {differ[:5]}"
    assert (ours / "config.json").read_bytes() == (theirs / "config.json").read_bytes()


# streamck's flags for a case (none: the defaults, which are the case's ignore list)
FLAGS = {
    "llama-FP8_DYNAMIC": ["--quantize-ignore", "lm_head"],  # a default given again: written once
    "qwen3moe-FP8_BLOCK": ["--quantize-lm-head"],
    "qwen3moe-MXFP4A16": ["--quantize-ignore", "re:.*self_attn.o_proj$"],  # added to the defaults
}


@pytest.mark.parametrize("case", [c for c in PTQ_CASES if not c[0].startswith("ct-")], ids=lambda c: c[0])
def test_same_as_model_free_ptq(quant, tmp_path, case):  # noqa: F811
    """The defaults (the head, the embeddings, a MoE router left out), --quantize-ignore added to
    them and --quantize-lm-head: model_free_ptq with that ignore list, config.json included."""
    name, base, scheme, ignore = case
    pad = ["--quantize-pad-partial"] if scheme == "FP8_BLOCK" else []  # as model_free_ptq pads partial blocks
    cli("rewrite", quant / base, "-o", tmp_path / "out", "--quantize", scheme, *FLAGS.get(name, []), *pad, check=0)
    assert_same_as_ptq(tmp_path / "out", quant / name)
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == list(ignore)


def test_ignore_notes_and_head_refusals(quant, tmp_path):  # noqa: F811
    """An ignore entry that matches nothing is named; --quantize-lm-head is refused where the head is
    tied (no lm_head.weight) or ignored too; the embeddings stay as they are stored."""
    out = tmp_path / "out"
    done = cli("rewrite", quant / "llama384", "-o", out, "--quantize", "FP8_DYNAMIC", "--quantize-ignore", "re:.*qproj",
               "--quantize-ignore", "model.layers.0.mlp", "--quantize-ignore", "model.layers.0.mlp.up_proj",
               check=0)  # fmt: skip
    assert "'re:.*qproj' matches no module" in done.stderr and "'model.layers.0.mlp' matches no" in done.stderr
    assert "up_proj' matches" not in done.stderr
    got, base = tensors(out), tensors(quant / "llama384")
    assert got["model.embed_tokens.weight"] == base["model.embed_tokens.weight"]
    assert got["lm_head.weight"] == base["lm_head.weight"]
    assert "model.layers.0.mlp.gate_proj.weight_scale" in got and "model.layers.0.mlp.up_proj.weight_scale" not in got
    _refused(cli("rewrite", quant / "llama-tied", "-o", out / "t", "--quantize", "NVFP4A16", "--quantize-lm-head"),
             out / "t", "--quantize-lm-head", "no lm_head.weight")  # fmt: skip
    _refused(cli("rewrite", quant / "llama384", "-o", out / "t", "--quantize", "NVFP4A16", "--quantize-lm-head",
                 "--quantize-ignore", "lm_head"), out / "t", "contradict")  # fmt: skip
    _refused(cli("rewrite", quant / "llama384", "-o", out / "t", "--quantize-lm-head"), out / "t", "--quantize")


def test_partial_block_tiles_are_noted(quant, tmp_path):  # noqa: F811
    """FP8_BLOCK on a side no multiple of 128 (written as model_free_ptq pads it) says that
    compressed-tensors cannot load it; a 128-multiple model is not noted."""
    done = cli("rewrite", quant / "llama", "-o", tmp_path / "a", "--quantize", "FP8_BLOCK", check=0)
    assert "side no multiple of 128" in done.stderr and "mlp.down_proj.weight [256, 320]" in done.stderr
    done = cli("rewrite", quant / "llama384", "-o", tmp_path / "b", "--quantize", "FP8_BLOCK", check=0)
    assert "multiple of 128" not in done.stderr


def test_keep_shards_and_verify(quant, tmp_path):  # noqa: F811
    """Sharded source, one output file per source file, every computed tensor recomputed by --verify."""
    out = tmp_path / "out"
    args = ["--quantize-ignore", "lm_head", "--quantize-ignore", "model.embed_tokens", "--quantize-pad-partial"]
    cli("rewrite", quant / "llama-sharded", "-o", out, "--quantize", "FP8_BLOCK", *args, "--keep-shards", "--verify",
        check=0)  # fmt: skip
    assert len(list(out.glob("*.safetensors"))) == len(list((quant / "llama-sharded").glob("*.safetensors"))) > 1
    assert_same_as_ptq(out, quant / "sharded-FP8_BLOCK")


def test_cast_then_quantize_in_one_pass(quant, tmp_path):  # noqa: F811
    """An fp32 source with --dtype bf16 --quantize: the bf16 base's quantization, bit for bit."""
    cli("rewrite", quant / "llama", "-o", tmp_path / "f32", "--dtype", "f32", check=0)
    cli("rewrite", tmp_path / "f32", "-o", tmp_path / "out", "--dtype", "bf16", "--quantize", "fp8_block",
        "--quantize-ignore", "lm_head", "--quantize-pad-partial", check=0)  # fmt: skip
    a, b = tensors(tmp_path / "out"), tensors(quant / "llama-FP8_BLOCK")
    assert a == b


def _refused(proc: subprocess.CompletedProcess, out: Path, *words: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), proc.stderr
    assert not out.exists()


def test_refusals(quant, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    _refused(cli("rewrite", quant / "llama", "-o", out, "--quantize", "INT3"), out, "unknown scheme", "FP8_BLOCK")
    already = quant / "llama-FP8_BLOCK"
    _refused(cli("rewrite", already, "-o", out, "--quantize", "FP8_DYNAMIC"), out, "already", "quantized")
    _refused(cli("rewrite", quant / "llama", "-o", out, "--quantize-ignore", "lm_head"), out, "--quantize")
    _refused(cli("rewrite", already, "-o", out, "--cast", "*weight_scale=f32"), out, "scales")


def test_shape_refused_with_its_ignore_entry(tmp_path):
    src = save(tmp_path / "m.safetensors", {
        "model.layers.0.mlp.up_proj.weight": np.ones((4, 8), np.float32),
        "model.ln_f.weight": np.ones(8, np.float32),  # 1-D, and its module does not end in "norm"
    })  # fmt: skip
    out = tmp_path / "out.safetensors"
    _refused(cli("rewrite", src, "-o", out, "--quantize", "FP8_DYNAMIC"), out, "model.ln_f.weight",
             "--quantize-ignore 'model.ln_f'")  # fmt: skip
    cli("rewrite", src, "-o", out, "--quantize", "FP8_DYNAMIC", "--quantize-ignore", "re:model\\.ln_", check=0)
    with safe_open(out, "np") as f:
        assert sorted(f.keys()) == ["model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight_scale",
                                    "model.ln_f.weight"]  # fmt: skip


def test_fp4_columns_refused_with_their_ignore_entry(tmp_path):
    """FP4 groups are 16 (NVFP4) or 32 (MXFP4) columns: a weight of 24 columns is refused (model_free_ptq too)."""
    src = save(tmp_path / "m.safetensors", {
        "model.layers.0.mlp.up_proj.weight": np.ones((4, 64), np.float32),
        "model.layers.0.mlp.down_proj.weight": np.ones((4, 48), np.float32),
    })  # fmt: skip
    out = tmp_path / "out.safetensors"
    _refused(cli("rewrite", src, "-o", out, "--quantize", "MXFP4A16"), out, "multiple of 32",
             "model.layers.0.mlp.down_proj.weight", "--quantize-ignore 'model.layers.0.mlp.down_proj'")  # fmt: skip
    cli("rewrite", src, "-o", out, "--quantize", "NVFP4A16", check=0)  # 48 is a multiple of 16


def test_nvfp4_global_scale_across_files(quant, tmp_path):  # noqa: F811
    """q, k and v (and gate, up) in different files of the source: one global scale each set, read
    in a first streaming pass; the one-file base's model_free_ptq output, bit for bit (model_free_ptq
    itself crashes on this layout: "Could not find inverse_weight_map for shard" for a file that
    holds only partners: up_proj here); --keep-shards and --verify."""
    index = json.loads((quant / "llama-split" / "model.safetensors.index.json").read_text())["weight_map"]
    attn, mlp = "model.layers.1.self_attn", "model.layers.0.mlp"
    sets = [[f"{attn}.{p}_proj" for p in "qkv"], [f"{mlp}.gate_proj", f"{mlp}.up_proj"]]
    assert all(len({index[f"{m}.weight"] for m in members}) > 1 for members in sets), index  # as the test needs
    out = tmp_path / "out"
    cli("rewrite", quant / "llama-split", "-o", out, "--quantize", "NVFP4A16", "--quantize-ignore", "lm_head",
        "--keep-shards", "--verify", check=0)  # fmt: skip
    assert len(list(out.glob("*.safetensors"))) == len(set(index.values()))
    assert_same_as_ptq(out, quant / "llama-NVFP4A16")
    got = tensors(out)
    for members in sets:
        assert len({got[f"{m}.weight_global_scale"][2] for m in members}) == 1
    assert got[f"{attn}.q_proj.weight_global_scale"] != got[f"{attn}.o_proj.weight_global_scale"]


CHILD = """
import sys
import torch
if sys.argv[1] != "baseline":
    from streamck import rewrite
    rewrite(sys.argv[2], sys.argv[3], quantize=sys.argv[1])
print(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")))
"""


def _peak(*args: str) -> float:
    child = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True)
    assert child.returncode == 0, child.stderr
    return int(child.stdout.split()[-1]) / 1024


@pytest.mark.parametrize("scheme", ["FP8_BLOCK", "FP8_DYNAMIC", "NVFP4A16", "MXFP4A16"])
def test_memory_is_a_band_not_a_tensor(tmp_path, scheme):
    """A 96 MiB bf16 weight: the peak stays within a few bands of torch's import."""
    import torch
    from safetensors.torch import save_file

    rows, cols = 3072, 16384
    bits = (np.arange(rows * cols, dtype=np.uint32) * 2654435761 >> 20).astype(np.uint16) & 0x3FFF  # |x| < 2
    src = tmp_path / "m.safetensors"
    save_file({"w.weight": torch.from_numpy(bits.reshape(rows, cols).view(np.int16)).view(torch.bfloat16)}, src)
    del bits
    torch_only = _peak("baseline")
    peak = _peak(scheme, str(src), str(tmp_path / "out.safetensors"))
    assert peak - torch_only < 64, (torch_only, peak)


@pytest.mark.parametrize("scheme", ["FP8_BLOCK", "NVFP4A16", "MXFP4A16"])
def test_merge_lora_then_quantize_in_one_pass(tmp_path, scheme):
    """--merge-lora with --quantize: the merged weights quantized as model_free_ptq quantizes
    PEFT's merge_and_unload output (both producers run here), in one streaming pass. NVFP4's
    global scale of q/k/v and gate/up is taken over the merged q, v and gate with the unmerged k, up."""
    pytest.importorskip("peft")
    from lora_fixtures import make_adapter, make_base, peft_merge
    from quant_fixtures import DEFAULT, run_oracle

    base = make_base(tmp_path / "base")
    targets = ["q_proj", "v_proj", "gate_proj", "down_proj"]
    adapter = make_adapter(base, tmp_path / "adapter", target_modules=targets)
    peft_merge(base, adapter, tmp_path / "merged")
    run_oracle("ptq", tmp_path / "merged", tmp_path / "oracle", scheme, *DEFAULT)
    out = tmp_path / "out"
    pad = ["--quantize-pad-partial"] if scheme == "FP8_BLOCK" else []  # as model_free_ptq pads partial blocks
    proc = cli("rewrite", base, "-o", out, "--merge-lora", adapter, "--quantize", scheme,
               "--quantize-ignore", "lm_head", "--verify", *pad, check=0)  # fmt: skip
    assert_same_as_ptq(out, tmp_path / "oracle")
    dry = cli("rewrite", base, "-o", out, "--merge-lora", adapter, "--quantize", scheme, "--dry-run", *pad, check=0)
    part = "weight" if scheme.startswith("FP8") else "packed"
    assert f"+LoRA {scheme} {part}" in dry.stdout, proc.stderr
