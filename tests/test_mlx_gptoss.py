"""MLX output of gpt-oss (#51): the folder mlx_lm.convert writes, tensor for tensor, from transformers'
bf16 save and from the published MXFP4 layout, and one mlx_lm.load runs with the reference's logits
(tests/mlx_gptoss_models.py builds the sources and the references).

Every case is written by streamck here, then one child in the mlx venv (tests/mlx_driver.py) reads
both folders' tensors with ``mx.load`` and runs both with ``mlx_lm.load``; the tests read its answers.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from mlx_env import run_jobs, write_mlx
from mlx_gptoss_models import SHARD, gptoss_world

from streamck.transforms import mlx_quant
from streamck.writer.formats.mlx import gptoss

TOKENS = list(b"Hello, gpt-oss in MLX: 0123456789")  # past the sliding window (16), below both vocabularies
BANDS = 200  # values per band for *-bands: a few rows of an expert at a time, three computed at once
# *-bands also read the fused experts a few rows at a time (gptoss.BAND_BYTES: the case's bytes)
# case -> (source, streamck's options, the mlx_lm.convert folder it must equal: tests/mlx_gptoss_models.py)
CASES = {
    "bf16": ("bf16", {}, "bf16"),
    "bf16-f32": ("bf16", {"dtype": "f32"}, "bf16-f32"),
    "bf16-q4": ("bf16", {"quantize": "MLX_Q4"}, "bf16-q4"),
    "bf16-q4-bands": ("bf16", {"quantize": "MLX_Q4", "bands": 3 * 384}, "bf16-q4"),  # 3 rows of gate_up_proj
    "bf16-mxfp4": ("bf16", {"quantize": "MLX_MXFP4"}, "bf16-mxfp4"),
    "bf16-q8-shards": ("bf16", {"quantize": "MLX_Q8", "max_shard_size": SHARD}, "bf16-q8-shards"),
    "mxfp4": ("mxfp4", {}, "mxfp4"),
    "mxfp4-f32": ("mxfp4", {"dtype": "f32"}, "mxfp4-f32"),
    "mxfp4-q4": ("mxfp4", {"quantize": "MLX_Q4"}, "mxfp4-q4"),
    "mxfp4-mxfp4": ("mxfp4", {"quantize": "MLX_MXFP4"}, "mxfp4-mxfp4"),
    "mxfp4-bands": ("mxfp4", {"bands": 3 * 64}, "mxfp4"),  # 3 rows of gate_up_proj_blocks: odd bands
    # the teeth: gate and up taken from each other's columns (rows) of gate_up_proj
    "bf16-f32-swapped": ("bf16", {"dtype": "f32", "swapped": True}, "bf16-f32"),
    "mxfp4-swapped": ("mxfp4", {"swapped": True}, "mxfp4"),
}
SWAPPED = (("gate_proj", 1), ("up_proj", 0))


def _write(src, out, options: dict) -> None:
    options = dict(options)
    with pytest.MonkeyPatch.context() as patch:
        if "bands" in options:
            patch.setattr(gptoss, "BAND_BYTES", options.pop("bands"))
            patch.setattr(mlx_quant, "BAND_VALUES", BANDS)
            patch.setattr(mlx_quant, "THREADS", 3)
        if options.pop("swapped", False):
            patch.setattr(gptoss, "HALVES", SWAPPED)
        write_mlx(src, out, **options)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Every case written by streamck, compared with its reference and run, in one child."""
    base = gptoss_world(tmp_path_factory)
    root = tmp_path_factory.mktemp("mlx-gptoss")
    jobs, asks = [], {}
    for case, (src, options, ref) in CASES.items():
        _write(base / src, root / case, options)
        asks[case] = len(jobs)
        jobs.append({"op": "compare", "a": str(root / case), "b": str(base / "refs" / ref)})
        paths = [str(root / case), str(base / "refs" / ref)]  # MLX's CPU runs the experts in float32 only
        jobs.append({"op": "logits", "paths": paths, "tokens": TOKENS, "save": str(root / f"{case}.npy"), "f32": True})
    answers = run_jobs(jobs)
    errors = [a["error"] for a in answers if "error" in a]
    assert not errors, errors
    return {"base": base, "root": root, **{c: (answers[i], answers[i + 1]) for c, i in asks.items()}}


GOOD = [c for c in CASES if "swapped" not in c]


@pytest.mark.parametrize("case", GOOD)
def test_equals_mlx_lm_convert(world, case):
    """Names, dtypes, shapes and bytes of every tensor as mx.load reads them, config.json and the
    index as parsed JSON, and the files are mlx_lm.convert's (but chat_template.jinja, which
    transformers' tokenizer save takes out of tokenizer_config.json, where streamck leaves it)."""
    compared, _ = world[case]
    assert (compared["only_a"], compared["only_b"], compared["differ"]) == ([], [], [])
    assert compared["count"] > 40
    assert compared["config_equal"] and compared["index_equal"]
    ours, theirs = map(set, compared["files"])
    assert ours - theirs == set() and theirs - ours <= {"chat_template.jinja"}


def test_cases_hold_what_they_say(world):
    """The MXFP4 source's experts stay packed (U32 words, E8M0 bytes) in every case; the bf16
    source's are packed only when quantized; the sharded case is cut (the comparison above would
    pass on two unquantized or unsharded folders)."""
    for case, (src, options, _) in CASES.items():
        dtypes = world[case][0]["dtypes"]
        fp_mode = src == "mxfp4" or options.get("quantize") == "MLX_MXFP4"
        assert ("mlx.core.uint8" in dtypes) == fp_mode, case
        assert ("mlx.core.uint32" in dtypes) == (fp_mode or "quantize" in options), case
    names = {n for n in world["bf16-q8-shards"][0]["files"][0] if n.startswith("model-0000")}
    assert len(names) >= 3


@pytest.mark.parametrize("case", GOOD)
def test_mlx_lm_loads_it(world, case):
    """mlx_lm.load of streamck's folder gives the logits of mlx_lm.convert's, exactly, and its
    tokenizer encodes as the reference's does."""
    _, ran = world[case]
    assert ran["max_diff"] == 0.0
    assert ran["encoded"][0] == ran["encoded"][1] and len(ran["encoded"][0]) > 3


def test_a_swapped_deinterleave_fails(world):
    """gate and up taken from each other's half of gate_up_proj: the weights and biases (the MXFP4
    source's weights and scales: its biases are transformers' zeros) differ from mlx_lm.convert's,
    and so do the logits."""
    for case, leaves in (("bf16-f32-swapped", ("weight", "bias")), ("mxfp4-swapped", ("weight", "scales"))):
        compared, ran = world[case]
        differ = set(compared["differ"])
        for layer in (0, 1):
            pre = f"model.layers.{layer}.mlp.experts"
            assert {f"{pre}.{p}.{leaf}" for p in ("gate_proj", "up_proj") for leaf in leaves} <= differ, case
        assert not any("down_proj" in n for n in differ), case
        assert ran["max_diff"] > 1e-2, case


def _transformers_logits(src, mxfp4: bool) -> np.ndarray:
    """transformers' float32 logits of TOKENS (the MXFP4 experts as its Mxfp4Config(dequantize=True)
    loads them), its YaRN ``truncate`` set: mlx-lm 0.32.2's YarnRoPE ignores the config's ``false``
    and rounds the correction range to whole dimensions (1.4e-3 apart on this prompt without it)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, Mxfp4Config

    config = AutoConfig.from_pretrained(src)
    config.rope_parameters["truncate"] = True
    extra = {"quantization_config": Mxfp4Config(dequantize=True)} if mxfp4 else {}
    model = AutoModelForCausalLM.from_pretrained(src, config=config, dtype=torch.float32, **extra)
    model.float()  # its MXFP4 load keeps the experts in bf16 (exact values): computed in float32, as MLX's are
    with torch.no_grad():
        return model(torch.tensor([TOKENS])).logits[0].numpy()


@pytest.mark.parametrize(
    ("case", "src", "swapped"),
    [("bf16-f32", "bf16", "bf16-f32-swapped"), ("bf16", "bf16", None), ("mxfp4", "mxfp4", "mxfp4-swapped")],
)
def test_close_to_transformers(world, case, src, swapped):
    """Unquantized (the MXFP4 experts as they are), MLX's float32 logits are transformers' to 1e-4
    (bf16 weights: the same values in both); a swapped de-interleave's are far from them."""
    expected = _transformers_logits(world["base"] / src, src == "mxfp4")
    ours = np.load(world["root"] / f"{case}.npy")
    assert (
        ours.shape
        == expected.shape
        == (len(TOKENS), json.loads((world["base"] / src / "config.json").read_text())["vocab_size"])
    )
    assert np.abs(ours - expected).max() < 1e-4
    if swapped:
        assert np.abs(np.load(world["root"] / f"{swapped}.npy") - expected).max() > 0.1


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "streamck", *args], capture_output=True, text=True, timeout=120)


def _edited(world, tmp_path, src: str, config: dict | None = None, drop: str = ""):
    """A copy of source ``src`` with ``config`` merged into config.json (None values removed) and
    the tensors whose name ends with ``drop`` left out."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path / "src"
    shutil.copytree(world["base"] / src, out)
    saved = json.loads((out / "config.json").read_text())
    saved = {k: v for k, v in {**saved, **(config or {})}.items() if v is not None}
    (out / "config.json").write_text(json.dumps(saved))
    if drop:
        tensors = load_file(out / "model.safetensors")
        save_file({k: v for k, v in tensors.items() if not k.endswith(drop)}, out / "model.safetensors")
    return out


BAD = {
    "MXFP4 blocks without quant_method mxfp4": ("mxfp4", {"quantization_config": None}, "", "quant_method mxfp4"),
    "experts the config does not count": ("bf16", {"num_local_experts": 8}, "", "but config.json says 8"),
    "MXFP4 blocks without their scales": ("mxfp4", {}, "gate_up_proj_scales", "gate_up_proj_blocks"),
}


@pytest.mark.parametrize("what", BAD)
def test_bad_input_is_one_line(world, tmp_path, what):
    """One line naming what is wrong, exit 2, nothing written."""
    src, config, drop, said = BAD[what]
    proc = _cli("rewrite", str(_edited(world, tmp_path, src, config, drop)), "-o", str(tmp_path / "out"),
                "--format", "mlx")  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert said in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "out").exists()


# One child: its high-water mark (KiB) after the imports, then after the rewrite, one line each.
PEAK_CHILD = """
import sys
import streamck
def peak():
    print(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")))
peak()
streamck.rewrite(sys.argv[1], sys.argv[2], format="mlx", quantize="MLX_Q4")
peak()
"""


def _big_layer(folder, experts: int = 16, hidden: int = 1024, inter: int = 4160) -> None:
    """One gpt-oss layer's experts and router in bf16 (random finite values), written by hand (no torch)."""
    rng = np.random.default_rng(0)
    pre = "model.layers.0.mlp.experts."
    shapes = {pre + "gate_up_proj": (experts, hidden, 2 * inter), pre + "down_proj": (experts, inter, hidden),
              pre + "gate_up_proj_bias": (experts, 2 * inter), pre + "down_proj_bias": (experts, hidden),
              "model.layers.0.mlp.router.weight": (experts, hidden)}  # fmt: skip
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 2 * int(np.prod(shape))
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    folder.mkdir()
    config = {"model_type": "gpt_oss", "num_local_experts": experts, "num_hidden_layers": 1, "hidden_size": hidden}
    (folder / "config.json").write_text(json.dumps(config))
    with open(folder / "model.safetensors", "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for shape in shapes.values():
            f.write(rng.integers(0, 0x3F80, int(np.prod(shape)), dtype=np.uint16).tobytes())  # |x| < 1, no NaN


def test_expert_stack_is_read_a_band_at_a_time(tmp_path):
    """A layer whose gate_up_proj stack is 260 MiB of bf16 (sixteen 16.25 MiB experts) to MLX_Q4: the
    peak RSS (the OS's VmHWM) stays under 96 MiB over the child's imports, well below the stack alone."""
    src, out = tmp_path / "src", tmp_path / "out"
    _big_layer(src)
    child = subprocess.run([sys.executable, "-c", PEAK_CHILD, str(src), str(out)], capture_output=True, text=True,
                           timeout=600)  # fmt: skip
    assert child.returncode == 0, child.stderr[-2000:]
    imported, written = map(int, child.stdout.split()[-2:])
    over = (written - imported) / 1024
    print(f"gpt-oss layer, a 260 MiB gate_up_proj stack -> MLX_Q4: {over:.1f} MiB over the import")
    assert over < 96
    with open(out / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert header["model.layers.0.mlp.experts.gate_proj.weight"]["shape"] == [16, 4160, 1024 // 8]
