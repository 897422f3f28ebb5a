"""GGUF output of Mixture-of-Experts models (#50, Build item 3): Qwen3-MoE and Mixtral, experts stacked
per layer as llama.cpp's convert_hf_to_gguf.py stacks them, byte for byte, from per-expert files
(``save_pretrained``) and from transformers 5's fused runtime layout (what a trainer saves), run
in llama.cpp against transformers' logits, and written one expert slice at a time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from gguf_env import contents, logprob_deltas, run_llama_cpp, write_gguf
from gguf_models import big_moe, fused_model, reference_file, tiny_model

KINDS = ("qwen3moe", "mixtral")
PROMPT = [9906, 1917, 11, 420, 374, 264]  # ids both vocabularies hold
# the reference's runs (each ~20 s on a cold machine, then cached): Q8_0 for both, bf16 for Qwen3-MoE
REFERENCE = [("qwen3moe", "bf16"), ("qwen3moe", "q8_0"), ("mixtral", "q8_0")]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return {kind: tiny_model(tmp_path_factory, kind) for kind in KINDS}


@pytest.fixture(scope="module")
def written(models, tmp_path_factory):
    """streamck's GGUF of a family's model as a type, written once for the module's tests
    (each write is seconds: gguf-py packs a 128k-token vocabulary and its merges)."""
    where, files = tmp_path_factory.mktemp("gguf-moe"), {}

    def get(kind: str, outtype: str) -> Path:
        if (kind, outtype) not in files:
            files[kind, outtype] = write_gguf(models[kind], where / f"{kind}-{outtype}" / "model.gguf", outtype)[0]
        return files[kind, outtype]

    return get


@pytest.mark.parametrize(("kind", "outtype"), REFERENCE)
def test_equals_the_reference(models, written, kind, outtype):
    """Every key (expert counts and lengths included), every tensor info (the stacked experts'
    [E, rows, cols] shapes and places, the router kept F32) and every byte are the reference's."""
    ours = written(kind, outtype)
    ref = reference_file(models[kind], outtype)
    (ref_kvs, ref_infos, ref_data), (kvs, infos, data) = contents(ref), contents(ours)
    assert kvs == ref_kvs
    assert infos == ref_infos
    assert [n for n in data if data[n] != ref_data[n]] == []
    assert ours.read_bytes() == ref.read_bytes()


@pytest.mark.parametrize("kind", KINDS)
def test_the_experts_are_stacked(written, kind):
    """What the equality above covers, seen in the file: one [E, …] tensor per projection and
    layer, in GGUF's reversed order of axes, and the router in F32 in a Q8_0 file."""
    _, infos, _ = contents(written(kind, "q8_0"))
    shapes = {name: (shape, kind) for name, shape, kind, _ in infos}
    inter = 32 if kind == "qwen3moe" else 96
    assert shapes["blk.1.ffn_gate_exps.weight"] == ([64, inter, 4], "Q8_0")
    assert shapes["blk.1.ffn_down_exps.weight"] == ([inter, 64, 4], "Q8_0")
    assert shapes["blk.0.ffn_gate_inp.weight"] == ([64, 4], "F32")
    assert len([n for n in shapes if "_exps." in n]) == 3 * 2  # three projections, two layers


@pytest.mark.parametrize("kind", KINDS)
def test_the_fused_layout_gives_the_same_file(tmp_path_factory, tmp_path, kind):
    """The same model as transformers 5 holds it and a trainer saves it (``experts.gate_up_proj``
    [E, 2I, H], ``experts.down_proj`` [E, H, I]) gives the reference's file of its per-expert
    save: each expert's rows read from the fused tensor, restacked by projection."""
    fused = fused_model(tmp_path_factory, kind)
    ours = write_gguf(fused, tmp_path / "model.gguf", "q8_0")[0]
    ref = reference_file(tiny_model(tmp_path_factory, kind), "q8_0")
    assert ours.read_bytes() == ref.read_bytes()


TOLERANCE = {"f32": 1e-3, "q8_0": 0.3}  # |log p| difference, as tests/test_gguf.py's


@pytest.mark.parametrize("kind", KINDS)
def test_llama_cpp_runs_it(models, written, tmp_path, monkeypatch, kind):
    """llama.cpp (one child per family) runs the f32 and the Q8_0 file within TOLERANCE of
    transformers' log-probabilities (measured: 1.3e-5 and 0.096 at most); for Qwen3-MoE, the same
    f32 file with each layer's experts stacked in reverse order is off by 4.0, so the check can fail."""
    from streamck.writer.formats.gguf import experts

    files = [written(kind, t) for t in TOLERANCE]
    if kind == "qwen3moe":
        name = experts.Stacker._name
        monkeypatch.setattr(experts.Stacker, "_name", lambda s, layer, e, proj: name(s, layer, s.count - 1 - e, proj))
        files += write_gguf(models[kind], tmp_path / "reversed.gguf", "f32")
    runs = run_llama_cpp(files, PROMPT)
    for outtype, run in zip(TOLERANCE, runs, strict=False):
        worst, agree = logprob_deltas(models[kind], PROMPT, run)
        assert len(run["tokens"]) == 8 and worst < TOLERANCE[outtype], (outtype, worst, agree)
    if kind == "qwen3moe":
        worst, _ = logprob_deltas(models[kind], PROMPT, runs[-1])
        assert worst > 20 * TOLERANCE["f32"], worst


PEAK_CHILD = """
import sys
from streamck import rewrite
from streamck.writer.formats.gguf import format as fmt

def status(key):
    return int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith(key)))

start = []
original = fmt.GGUF.write

def write(self, shard, tensors, out):  # the peak from here on: the tensors' bytes, not the header's
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    start.append(status("VmRSS:"))
    original(self, shard, tensors, out)

fmt.GGUF.write = write
rewrite(sys.argv[1], sys.argv[2], dtype=sys.argv[3])
print(start[0], status("VmHWM:"))
"""
MIB = 1 << 20


def test_a_stack_over_256_mib_is_written_one_slice_at_a_time(models, tmp_path):
    """A layer of 16 experts of 16 MiB each (three stacked tensors of 256.06 MiB) written as f16
    (a cast: every value widened, in bands): from the first tensor byte to the end, the OS's
    peak RSS grows by less than one expert slice (measured: under 1 MiB). The reference holds
    each stack whole, in float32 too (bench/cases/gguf.py's MoE row)."""
    experts, inter = 16, 16 * MIB // 128 + 32  # an expert slice is inter * 64 bf16 values
    src = big_moe(tmp_path / "model", models["qwen3moe"], experts, inter)
    out = tmp_path / "model.gguf"
    child = subprocess.run([sys.executable, "-c", PEAK_CHILD, str(src), str(out), "f16"], capture_output=True,
                           text=True, timeout=300)  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    start, peak = (int(v) * 1024 for v in child.stdout.split())
    _, infos, _ = contents(out, limit=16 * MIB)  # the header
    stack = {n: s for n, s, _, _ in infos}["blk.0.ffn_up_exps.weight"]
    assert stack == [64, inter, experts] and 64 * inter * experts * 2 > 256 * MIB
    assert peak - start < inter * 64 * 2, f"grew {(peak - start) / MIB:.1f} MiB from {start / MIB:.0f} MiB"


def _edited(src: Path, dst: Path, tensors=None, config=None) -> Path:
    """A copy of model folder ``src`` at ``dst``, its tensors and config.json passed through the
    edits given."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if tensors:
        save_file(tensors(load_file(dst / "model.safetensors")), dst / "model.safetensors", metadata={"format": "pt"})
    if config:
        (dst / "config.json").write_text(json.dumps(config(json.loads((dst / "config.json").read_text()))))
    return dst


@pytest.mark.parametrize(
    ("tensors", "config", "message"),
    [
        (lambda ts: {n: t for n, t in ts.items() if n != "model.layers.1.mlp.experts.2.up_proj.weight"}, None,
         "MoE block model.layers.1.mlp: experts 2 have no up_proj.weight"),
        (None, lambda c: {**c, "architectures": ["Qwen3ForCausalLM"]},
         "config.json has num_local_experts: GGUF output does not write that yet"),
        (None, lambda c: {**c, "scoring_func": "sigmoid"}, "config.json has scoring_func"),
    ],
    ids=["an-expert-missing", "experts-in-a-dense-family", "a-routing-it-does-not-write"],
)  # fmt: skip
def test_refusals(models, tmp_path, tensors, config, message):
    """Bad input: one line naming what is wrong, nothing written."""
    from streamck.errors import PlanError

    src = _edited(models["qwen3moe"], tmp_path / "src", tensors, config)
    out = tmp_path / "out.gguf"
    with pytest.raises(PlanError, match=message) as info:
        write_gguf(src, out)
    assert "\n" not in str(info.value) and not out.exists()
