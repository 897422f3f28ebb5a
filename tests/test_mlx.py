"""MLX output (#51): the folder ``mlx_lm.convert`` writes, tensor for tensor, and one ``mlx_lm.load``
runs with the reference's logits (tests/mlx_models.py and mlx_env.py build both sides).

Every case is written by streamck here, then one child in the mlx venv (tests/mlx_driver.py)
converts the same model with mlx_lm.convert, reads both folders' tensors with ``mx.load`` and
runs both with ``mlx_lm.load``; the tests read its answers.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mlx_env import run_jobs, write_mlx
from mlx_models import DENSE_KINDS, MOE_KINDS, SHARD, VOCAB, model_folder, references, source

from streamck.transforms import dequantize, mlx_quant

TOKENS = [256, 72, 101, 108, 108, 111, 44, 32, 50, 51]  # BOS, then "Hello, 23" byte by byte

BANDS = 200  # values per band for the *-bands cases: three rows of 64 (a group) at a time
SAVES = ("hf", "fused")  # a MoE's per-expert save_pretrained folder and a trainer's fused state dict
# case -> (model, streamck's options, the mlx_lm.convert folder it must equal: tests/mlx_models.py)
CASES = {
    "llama": ("llama", {}, "llama"),
    "llama-f16": ("llama", {"dtype": "f16"}, "llama-f16"),
    "llama-f32": ("llama", {"dtype": "f32"}, "llama-f32"),
    "llama-q4": ("llama", {"quantize": "MLX_Q4"}, "llama-q4"),
    "llama-q8": ("llama", {"quantize": "MLX_Q8"}, "llama-q8"),
    "llama-q4-g32-f32": ("llama", {"quantize": "MLX_Q4", "group_size": 32, "dtype": "f32"}, "llama-q4-g32-f32"),
    "llama-shards": ("llama", {"max_shard_size": SHARD}, "llama-shards"),
    "llama-mxfp4": ("llama", {"quantize": "MLX_MXFP4"}, "llama-mxfp4"),
    "llama-nvfp4": ("llama", {"quantize": "MLX_NVFP4"}, "llama-nvfp4"),
    "llama-mxfp8": ("llama", {"quantize": "MLX_MXFP8"}, "llama-mxfp8"),
    "llama-nvfp4-f16-bands": ("llama", {"quantize": "MLX_NVFP4", "dtype": "f16", "bands": True}, "llama-nvfp4-f16"),
    "qwen3_moe-fused-mxfp8": ("qwen3_moe/fused", {"quantize": "MLX_MXFP8"}, "qwen3_moe-mxfp8"),
    # quantized a few rows at a time (BAND_VALUES cut to BANDS: many bands, three computed at once)
    "llama-q4-bands": ("llama", {"quantize": "MLX_Q4", "bands": True}, "llama-q4"),
    "llama-mxfp4-bands": ("llama", {"quantize": "MLX_MXFP4", "bands": True}, "llama-mxfp4"),
    "mixtral-fused-q4-bands": ("mixtral/fused", {"quantize": "MLX_Q4", "bands": True}, "mixtral-q4"),
    "qwen3_moe-fused-mxfp4": ("qwen3_moe/fused", {"quantize": "MLX_MXFP4"}, "qwen3_moe-mxfp4"),
    "qwen3": ("qwen3", {}, "qwen3"),
    "qwen3-q4": ("qwen3", {"quantize": "MLX_Q4"}, "qwen3-q4"),
    "qwen3-q8-g128": ("qwen3", {"quantize": "MLX_Q8", "group_size": 128}, "qwen3-q8-g128"),
    **{f"{k}-{how}": (f"{k}/{how}", {}, k) for k in MOE_KINDS for how in SAVES},
    **{f"{k}-{how}-q4": (f"{k}/{how}", {"quantize": "MLX_Q4"}, f"{k}-q4") for k in MOE_KINDS for how in SAVES},
}  # fmt: skip


# A quantized source (a tiny model quantized by streamck's --quantize, as llm-compressor writes it:
# FP8 per row and per 128 × 128 block, NVFP4 and MXFP4 packed) to MLX: case -> (the model, the
# source's scheme, streamck's MLX options, the dtype its --dtype dequantizes to, mlx_lm.convert's
# arguments for that dequantized folder: the reference). *-bands: both passes a few rows at a time.
# A MoE's experts are stacked.
DEQUANT_CASES = {
    "llama-fp8dynamic": ("llama", "FP8_DYNAMIC", {}, "bf16", {}),
    "llama-fp8dynamic-q4-bands": ("llama", "FP8_DYNAMIC", {"quantize": "MLX_Q4", "bands": True}, "bf16",
                                  {"quantize": True}),
    "llama-nvfp4a16-q4": ("llama", "NVFP4A16", {"quantize": "MLX_Q4"}, "bf16", {"quantize": True}),
    "llama-fp8block-q4": ("llama", "FP8_BLOCK", {"quantize": "MLX_Q4"}, "bf16", {"quantize": True}),
    "llama-fp8dynamic-q8-f32": ("llama", "FP8_DYNAMIC", {"quantize": "MLX_Q8", "dtype": "f32"}, "f32",
                                {"quantize": True, "q_bits": 8, "dtype": "float32"}),
    "llama-nvfp4a16-f16": ("llama", "NVFP4A16", {"dtype": "f16"}, "f16", {"dtype": "float16"}),
    "llama-mxfp4a16": ("llama", "MXFP4A16", {}, "bf16", {}),
    "llama-nvfp4a16-nvfp4": ("llama", "NVFP4A16", {"quantize": "MLX_NVFP4"}, "bf16",
                             {"quantize": True, "q_mode": "nvfp4"}),
    "llama-fp8dynamic-mxfp8-bands": ("llama", "FP8_DYNAMIC", {"quantize": "MLX_MXFP8", "bands": True}, "bf16",
                                     {"quantize": True, "q_mode": "mxfp8"}),
    "llama-mxfp4a16-mxfp4-bands": ("llama", "MXFP4A16", {"quantize": "MLX_MXFP4", "bands": True}, "bf16",
                                   {"quantize": True, "q_mode": "mxfp4"}),
    "qwen3_moe-fp8dynamic": ("qwen3_moe/hf", "FP8_DYNAMIC", {}, "bf16", {}),
    "qwen3_moe-fp8dynamic-q4-bands": ("qwen3_moe/hf", "FP8_DYNAMIC", {"quantize": "MLX_Q4", "bands": True}, "bf16",
                                      {"quantize": True}),
    "mixtral-nvfp4a16-q4": ("mixtral/hf", "NVFP4A16", {"quantize": "MLX_Q4"}, "bf16", {"quantize": True}),
    "mixtral-mxfp4a16": ("mixtral/hf", "MXFP4A16", {}, "bf16", {}),
}  # fmt: skip


def dequant_jobs(models: dict[str, Path], root: Path) -> tuple[list[dict], dict[str, tuple[str, str]]]:
    """Each DEQUANT_CASES case written by streamck from its quantized source, and the jobs that
    convert streamck's own ``--dtype`` dequantization of that source with mlx_lm.convert (the
    reference): the convert jobs, and each case's (streamck's folder, the reference's)."""
    import streamck

    jobs, pairs = [], {}
    for case, (model, scheme, options, dtype, convert) in DEQUANT_CASES.items():
        src = root / f"src-{model.partition('/')[0]}-{scheme}"
        if not src.exists():
            pad = scheme == "FP8_BLOCK"  # the tiny models' sides are 64: one partial 128 × 128 tile each
            streamck.rewrite(source(models, model), src, quantize=scheme, quantize_pad_partial=pad)
        deq = root / f"deq-{src.name}-{dtype}"
        if not deq.exists():
            streamck.rewrite(src, deq, dtype=dtype)
        jobs.append({"op": "convert", "src": str(deq), "dst": str(root / f"ref-{case}"), **convert})
        options = dict(options)
        with pytest.MonkeyPatch.context() as patch:
            if options.pop("bands", False):  # both the dequantization and the quantization a few rows at a time
                patch.setattr(mlx_quant, "BAND_VALUES", BANDS)
                patch.setattr(mlx_quant, "THREADS", 3)
                patch.setattr(dequantize, "FP8_VALUES", BANDS)
                patch.setattr(dequantize, "FP4_VALUES", BANDS)
            write_mlx(src, root / case, **options)
        pairs[case] = (str(root / case), str(root / f"ref-{case}"))
    return jobs, pairs


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Every case written by streamck, compared with its reference and run, in one child."""
    models = {k: model_folder(tmp_path_factory, k) for k in (*DENSE_KINDS, *MOE_KINDS)}
    refs = references(tmp_path_factory, models)
    root = tmp_path_factory.mktemp("mlx")
    jobs, pairs = dequant_jobs(models, root)
    pairs |= {case: (str(root / case), str(refs / ref)) for case, (_, _, ref) in CASES.items()}
    asks = {}
    for case, (model, options, _) in CASES.items():
        options = dict(options)
        with pytest.MonkeyPatch.context() as patch:
            if options.pop("bands", False):
                patch.setattr(mlx_quant, "BAND_VALUES", BANDS)
                patch.setattr(mlx_quant, "THREADS", 3)
            write_mlx(source(models, model), root / case, **options)
    for case, (ours, ref) in pairs.items():
        asks[case] = len(jobs)
        jobs.append({"op": "compare", "a": ours, "b": ref})
        f32 = "/" in (CASES[case] if case in CASES else DEQUANT_CASES[case])[0]  # a MoE's
        jobs.append(
            {"op": "logits", "paths": [ours, ref], "tokens": TOKENS, "save": str(root / f"{case}.npy"), "f32": f32}
        )
    np.save(root / "rows.npy", oracle_rows())
    for i, (mode, group, bits, dtype) in enumerate(QUANTS):
        job = {"op": "quantize", "input": str(root / "rows.npy"), "save": str(root / f"quant-{i}.npz")}
        jobs.append({**job, "mode": mode, "group_size": group, "bits": bits, "dtype": dtype})
    answers = run_jobs(jobs)
    errors = [a["error"] for a in answers if "error" in a]
    assert not errors, errors
    return {"models": models, "root": root, **{c: (answers[i], answers[i + 1]) for c, i in asks.items()}}


# mx.quantize's modes, group sizes, bits and weight dtypes that test_quantize_is_mx_quantize holds as oracles
QUANTS = [
    ("affine", 64, 4, "bfloat16"),
    ("affine", 32, 8, "float16"),
    ("affine", 128, 4, "float32"),
    ("affine", 64, 8, "bfloat16"),
    ("mxfp4", 32, 4, "bfloat16"),
    ("mxfp4", 32, 4, "float32"),
    ("mxfp4", 32, 4, "float16"),
    ("nvfp4", 16, 4, "bfloat16"),
    ("nvfp4", 16, 4, "float16"),
    ("nvfp4", 16, 4, "float32"),
    ("mxfp8", 32, 8, "bfloat16"),
    ("mxfp8", 32, 8, "float16"),
    ("mxfp8", 32, 8, "float32"),
]
DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def oracle_rows() -> np.ndarray:
    """Rows of 256 values that reach every branch: random ones at several scales, a zero row, a
    constant one, one negative only, one of E2M1's ties and grid points (max 6: scale 1), tiny values."""
    rng = np.random.default_rng(5)
    rows = [rng.standard_normal(256) * s for s in (0.02, 1.0, 1e-3, 30.0) for _ in range(8)]
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 0.1, 5.5]
    rows += [np.zeros(256), np.full(256, 0.3), -np.abs(rng.standard_normal(256)), np.tile(ties + [-t for t in ties], 8)]
    rows += [rng.standard_normal(256) * 1e-30, np.tile([6.0, -6.0, 1e-3, 0.0], 64)]
    # E4M3's range and ties (scale 1 where 448 leads a group), values far below and above it
    rows += [np.tile([448.0, 1.0625, -1.1875, 3e-3, 0.0, -240.5, 17.0, 0.5], 32), rng.standard_normal(256) * 1e-6]
    rows += [rng.standard_normal(256) * 300.0, np.tile([5.0, -2.5, 0.75, 1e-9], 64)]
    return np.array(rows, dtype=np.float32)


@pytest.mark.parametrize("quant", range(len(QUANTS)), ids=[f"{m}-{g}-{b}-{d}" for m, g, b, d in QUANTS])
def test_quantize_is_mx_quantize(world, quant):
    """streamck.transforms.mlx_quant's numpy gives mx.quantize's bytes: packed words, scales
    (and biases), for rows cast to the weight's dtype first."""
    from streamck.transforms.mlx_quant import FP_MODES, affine, as_float32, from_float32, mxfp4

    mode, group, bits, dtype = QUANTS[quant]
    kind = DTYPES[dtype]
    w = as_float32(np.ascontiguousarray(from_float32(oracle_rows(), kind)), kind).reshape(-1, 256)
    if mode == "mxfp4":
        ours = mxfp4(w, group)
    elif mode in FP_MODES:
        ours = FP_MODES[mode](w, kind)
    else:
        packed, scales, biases = affine(w, group, bits)
        ours = (packed, from_float32(scales, kind), from_float32(biases, kind))
    theirs = np.load(world["root"] / f"quant-{quant}.npz")
    assert len(theirs.files) == len(ours)
    for i, mine in enumerate(ours):
        assert np.ascontiguousarray(mine).tobytes() == theirs[f"out{i}"].tobytes(), f"output {i}"


@pytest.mark.parametrize("case", [*CASES, *DEQUANT_CASES])
def test_equals_mlx_lm_convert(world, case):
    """Names, dtypes, shapes and bytes of every tensor as mx.load reads them, config.json and the
    index as parsed JSON, and the files are mlx_lm.convert's (but chat_template.jinja, which
    transformers' tokenizer save takes out of tokenizer_config.json, where streamck leaves it)."""
    compared, _ = world[case]
    assert (compared["only_a"], compared["only_b"], compared["differ"]) == ([], [], [])
    assert compared["count"] > 10
    assert compared["config_equal"] and compared["index_equal"]
    ours, theirs = map(set, compared["files"])
    assert ours - theirs == set() and theirs - ours <= {"chat_template.jinja"}
    if case == "llama-shards":
        assert len([n for n in ours if n.startswith("model-0000")]) >= 3  # cut where mlx_lm cuts


def test_quantized_cases_are_quantized(world):
    """The quantized cases hold packed words, and the FP modes' cases scale bytes (the comparison
    above would pass on two unquantized folders)."""
    asked = {case: options.get("quantize", "") for case, (_, options, _) in CASES.items()}
    asked |= {case: options.get("quantize", "") for case, (_, _, options, _, _) in DEQUANT_CASES.items()}
    for case, scheme in asked.items():
        compared, _ = world[case]
        assert ("mlx.core.uint32" in compared["dtypes"]) == bool(scheme), case
        fp_mode = scheme in ("MLX_MXFP4", "MLX_NVFP4", "MLX_MXFP8")
        assert ("mlx.core.uint8" in compared["dtypes"]) == fp_mode, case


def test_dequantized_sources_are_quantized(world):
    """The DEQUANT_CASES sources hold no float weight of a projection (the comparisons above would
    pass on an unquantized source): FP8 weights with scales, or packed FP4."""
    from streamck.source import open_checkpoint

    sources = {(model.partition("/")[0], scheme) for model, scheme, *_ in DEQUANT_CASES.values()}
    assert len(sources) == 7
    for model, scheme in sources:
        names = {n: r.dtype for n, r in open_checkpoint(world["root"] / f"src-{model}-{scheme}").tensors.items()}
        expert = "model.layers.0.mlp.experts.1.up_proj" if model == "qwen3_moe" else "model.layers.0.self_attn.q_proj"
        for module in ("model.layers.0.self_attn.q_proj", expert):
            if scheme.startswith("FP8"):
                assert names[f"{module}.weight"] == "F8_E4M3" and f"{module}.weight_scale" in names
            else:
                assert f"{module}.weight" not in names and names[f"{module}.weight_packed"] == "U8"


@pytest.mark.parametrize("case", [*CASES, *DEQUANT_CASES])
def test_mlx_lm_loads_it(world, case):
    """mlx_lm.load of streamck's folder gives the logits of mlx_lm.convert's, exactly, and its
    tokenizer encodes as the reference's does."""
    _, ran = world[case]
    assert ran["max_diff"] == 0.0
    assert ran["encoded"][0] == ran["encoded"][1] and len(ran["encoded"][0]) > 3


@pytest.mark.parametrize(("case", "tolerance"), [("llama-f32", 1e-3), ("llama", 0.1), ("qwen3", 0.1)])
def test_close_to_transformers(world, case, tolerance):
    """Unquantized, MLX's logits are transformers' (float32): to 1e-3 in f32, to 0.1 in bf16
    (MLX computes in bf16); and far from them for a model written wrong (the check has teeth)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(world["models"][CASES[case][0]], dtype=torch.float32)
    with torch.no_grad():
        expected = model(torch.tensor([TOKENS])).logits[0].numpy()
    ours = np.load(world["root"] / f"{case}.npy")
    assert ours.shape == expected.shape
    assert np.abs(ours - expected).max() < tolerance
    assert np.abs(ours - expected[::-1]).max() > 10 * tolerance


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "streamck", *args], capture_output=True, text=True, timeout=120)


BAD = {
    "a group size mx.quantize refuses": (["--quantize", "MLX_Q4", "--group-size", "16"], "--group-size 16"),
    "a group size nvfp4 refuses": (["--quantize", "MLX_NVFP4", "--group-size", "32"], "nvfp4 mode takes groups of 16"),
    "an unknown mode": (["--quantize", "MLX_Q3"], "mlx output writes MLX_Q4, MLX_Q8"),
    "another format's scheme": (["--quantize", "FP8_BLOCK"], "mlx output writes"),
    "a group size without a scheme": (["--group-size", "64"], "--group-size applies"),
    "a dtype MLX has not": (["--dtype", "fp64"], "--dtype fp64"),
}


@pytest.mark.parametrize("what", BAD)
def test_bad_input_is_one_line(world, tmp_path, what):
    """One line naming what is wrong, exit 2, nothing written."""
    args, said = BAD[what]
    proc = _cli("rewrite", str(world["models"]["llama"]), "-o", str(tmp_path / "out"), "--format", "mlx", *args)
    assert proc.returncode == 2, proc.stderr
    assert said in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--quantize", "MLX_Q4"], "--quantize MLX_Q4 is an MLX scheme: add --format mlx"),
        (["--group-size", "32"], "--group-size applies to --format mlx output, not to safetensors"),
        (["--make-vocab-size-divisible-by", "64"], "--make-vocab-size-divisible-by applies to --format megatron"),
        (["--format", "mlx", "--make-vocab-size-divisible-by", "64"], "to --format megatron output, not to mlx"),
    ],
)
def test_mlx_options_without_mlx_output(world, tmp_path, args, said):
    """An MLX scheme or --group-size for another format (a megatron option for mlx output): one line
    saying so, exit 2, nothing written."""
    proc = _cli("rewrite", str(world["models"]["llama"]), "-o", str(tmp_path / "out"), *args)
    assert proc.returncode == 2 and said in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_group_size_dividing_no_width(tmp_path, world):
    """Groups of 128 on a model whose every width is 64 (the Qwen3-MoE's): nothing would be quantized, refused."""
    src = world["models"]["qwen3_moe"] / "hf"
    proc = _cli("rewrite", str(src), "-o", str(tmp_path / "out"), "--format", "mlx", "--quantize", "MLX_Q4",
                "--group-size", "128")  # fmt: skip
    assert proc.returncode == 2 and "divide no weight's width" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_other_architectures_are_named(tmp_path, world):
    """A model_type MLX output has no family for: one line naming it, exit 2, nothing written."""
    import json
    import shutil

    src = tmp_path / "src"
    shutil.copytree(world["models"]["llama"], src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    proc = _cli("rewrite", str(src), "-o", str(tmp_path / "out"), "--format", "mlx")
    assert proc.returncode == 2 and "model_type gpt2" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_tokens_are_the_models():
    assert max(TOKENS) < VOCAB


def test_quantized_source_it_cannot_dequantize(tmp_path, world):
    """A quantized source in a format streamck does not dequantize (compressed-tensors' integer
    packing, here named by the config): one line naming it, exit 2, nothing written."""
    import json
    import shutil

    src = tmp_path / "src"
    shutil.copytree(world["root"] / "src-llama-FP8_DYNAMIC", src)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"]["format"] = "pack-quantized"
    (src / "config.json").write_text(json.dumps(config))
    proc = _cli("rewrite", str(src), "-o", str(tmp_path / "out"), "--format", "mlx", "--quantize", "MLX_Q4")
    assert proc.returncode == 2 and "dequantizing pack-quantized is not supported" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_closing_line_says_what_the_format_did(world, tmp_path):
    """The closing line counts the tensors as the format wrote them (quantized), not the plan it was given."""
    proc = _cli("rewrite", str(world["models"]["llama"]), "-o", str(tmp_path / "out"), "--format", "mlx",
                "--quantize", "MLX_Q4")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "computed (MLX affine 4-bit weight)" in last and "computed (MLX affine 4-bit scales)" in last, last
