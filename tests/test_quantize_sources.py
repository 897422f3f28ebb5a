"""--quantize straight from a training checkpoint, consolidated and quantized in one pass: the
same bytes (and config.json) as llm-compressor 0.14.0.1's model_free_ptq run on the consolidated
Hugging Face folder, the one the producer's own tool writes where it writes one with a config
(torchtitan's to_hf for the MoE), else the one streamck writes (its tests check that folder
against the producer). Sources: DCP (torch's dcp.save on 2 gloo ranks), DeepSpeed ZeRO-3,
HF Trainer + FSDP2 (SHARDED_STATE_DICT), torchtitan Llama-3, megatron-core GPT, and torchtitan
Qwen3-MoE with fused experts (written per expert, as save_pretrained names them, then quantized;
expert-parallel too); each fixture is the one its family's tests build."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import cli
from quant_fixtures import ROUTER, run_oracle
from test_fsdp import fsdp_cases  # noqa: F401  (session fixtures of those families' tests)
from test_megatron import megatron  # noqa: F401
from test_moe_titan import titan_moe  # noqa: F401
from test_quantize import tensors
from test_titan import titan  # noqa: F401

from streamck.plan.quant.layout import EMBEDDINGS

torch = pytest.importorskip("torch")
pytest.importorskip("llmcompressor", reason="llmcompressor==0.14.0.1 (scripts/test installs it)")


def same_as_ptq(src: Path, extra: list[str], tmp_path: Path, scheme: str, ignore: list[str],
                consolidated: Path | None = None) -> dict:  # fmt: skip
    """Rewrite ``src`` (with ``extra``) to HF (unless ``consolidated`` is given), run model_free_ptq
    on that folder, and rewrite ``src`` again with --quantize in one pass: both outputs equal.
    Returns the quantized tensors."""
    if consolidated is None:
        consolidated = tmp_path / "hf"
        cli("rewrite", src, "-o", consolidated, *extra, check=0)
    run_oracle("ptq", consolidated, tmp_path / "oracle", scheme, *serving_ignore(consolidated, ignore))
    out = tmp_path / "out"
    flags = [a for entry in ignore for a in ("--quantize-ignore", entry)]
    flags += ["--quantize-pad-partial"] if scheme == "FP8_BLOCK" else []  # model_free_ptq pads partial blocks
    cli("rewrite", src, "-o", out, *extra, "--quantize", scheme, *flags, "--verify", check=0)
    ours, theirs = tensors(out), tensors(tmp_path / "oracle")
    wide = scheme.endswith("A16") and any(dtype == "F32" for n, (dtype, _, _) in theirs.items() if not _scale(n))
    if wide:  # an fp32 source to an A16 scheme: the rest written in bf16 (test_quantize_serve: what runs)
        theirs = {n: t if _scale(n) or t[0] != "F32" else _bf16(t) for n, t in theirs.items()}
    assert sorted(ours) == sorted(theirs)
    assert [n for n in ours if ours[n] != theirs[n]] == []
    if (consolidated / "config.json").exists() and not wide:
        assert (out / "config.json").read_bytes() == (tmp_path / "oracle" / "config.json").read_bytes()
    elif (consolidated / "config.json").exists():
        config, oracle = (json.loads((d / "config.json").read_text()) for d in (out, tmp_path / "oracle"))
        assert config == {**oracle, "dtype": "bfloat16"}
    return ours


def _scale(name: str) -> bool:
    return name.endswith(("_scale", "_global_scale"))


def _bf16(t: tuple[str, list[int], bytes]) -> tuple[str, list[int], bytes]:
    """An F32 tensor (dtype, shape, bytes) cast to BF16 by torch (round to nearest even)."""
    data = torch.frombuffer(bytearray(t[2]), dtype=torch.float32).to(torch.bfloat16)
    return "BF16", t[1], data.view(torch.uint8).numpy().tobytes()


def serving_ignore(folder: Path, given: list[str]) -> list[str]:
    """model_free_ptq's ignore list for streamck's defaults on the checkpoint in ``folder`` (the
    head, the input embeddings it holds, a MoE router), then ``given``."""
    modules = {n.rpartition(".")[0] for n in tensors(folder)}
    embeddings = sorted(m for m in modules if m.rpartition(".")[2] in EMBEDDINGS)
    return list(dict.fromkeys(["lm_head", *embeddings, ROUTER, *given]))


def _quantized(got: dict) -> list[str]:
    return sorted(n.rpartition(".")[0] for n in got if n.endswith(".weight_scale"))


def test_dcp_to_fp8_block(dcp_ckpts, tmp_path):
    """torch's DCP of two ranks: the embedding, Shard(0) over 51 + 50 rows, in one 128-row tile
    (renamed: an embedding is left out by default)."""
    got = same_as_ptq(dcp_ckpts["dcp"], ["--rename", "embed_tokens=proj"], tmp_path, "FP8_BLOCK", [])
    assert _quantized(got) == ["model.proj"]


def test_zero3_to_fp8_dynamic(zero_cases, tmp_path):
    """DeepSpeed ZeRO-3 over 2 ranks (fp32 master weights, flat partitions of odd widths)."""
    case = zero_cases["z3_w2_bf16"]
    got = same_as_ptq(case["checkpoint"], [], tmp_path, "FP8_DYNAMIC", ["lm_head"])
    assert _quantized(got) == ["body.0", "embed", "frozen", "head"]


def test_fsdp2_to_fp8_block(fsdp_cases, tmp_path):  # noqa: F811
    """HF Trainer + FSDP2's SHARDED_STATE_DICT (DCP), with the run's config beside it."""
    from test_fsdp import with_config

    ck = with_config(fsdp_cases["fsdp2_sharded_untied"], tmp_path)
    got = same_as_ptq(ck, [], tmp_path, "FP8_BLOCK", ["lm_head"])
    assert "model.layers.0.self_attn.q_proj" in _quantized(got)


def test_torchtitan_to_nvfp4_and_fp8(titan, tmp_path):  # noqa: F811
    """torchtitan Llama-3 (q/k unpermuted, w1/w3 renamed): NVFP4's global scales over the renamed q/k/v, gate/up."""
    case = titan["llama3"]
    extra = ["--plan", "torchtitan-llama3", "--hf-config", str(case / "config.json")]
    step = case / "checkpoint" / "step-1"
    for scheme in ("FP8_BLOCK", "NVFP4A16"):
        (tmp_path / scheme).mkdir()
        got = same_as_ptq(step, extra, tmp_path / scheme, scheme, ["lm_head"])
        assert "model.layers.0.mlp.up_proj.weight_scale" in got


def test_megatron_to_fp8_dynamic(megatron, tmp_path):  # noqa: F811
    """megatron-core GPT (fused linear_qkv and linear_fc1 split as the HF names)."""
    got = same_as_ptq(megatron["gpt"], ["--plan", "megatron-gpt"], tmp_path, "FP8_DYNAMIC", ["lm_head"])
    assert "model.layers.0.self_attn.k_proj" in _quantized(got)


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_moe_ep2"])
def test_torchtitan_moe_per_expert_to_fp8(titan_moe, tmp_path, name):  # noqa: F811
    """torchtitan Qwen3-MoE, fused experts [E, ...] (and expert parallel over 2 ranks): each expert
    written and quantized per expert; model_free_ptq runs on torchtitan's own to_hf tensors, beside
    the config streamck writes for them (the given one with its "dtype" filled in)."""
    case = titan_moe[name]
    extra = ["--plan", "torchtitan", "--hf-config", str(case / "config.json")]
    cli("rewrite", case / "checkpoint" / "step-1", "-o", tmp_path / "hf", *extra, check=0)
    consolidated = tmp_path / "to_hf"
    consolidated.mkdir()
    shutil.copy(case / "to_hf.safetensors", consolidated / "model.safetensors")
    shutil.copy(tmp_path / "hf" / "config.json", consolidated)
    got = same_as_ptq(case / "checkpoint" / "step-1", extra, tmp_path, "FP8_DYNAMIC", ["lm_head", "re:.*mlp.gate$"],
                      consolidated)  # fmt: skip
    experts = [n for n in _quantized(got) if ".mlp.experts." in n]
    assert len(experts) == 2 * 4 * 3 and "model.layers.1.mlp.experts.3.down_proj" in experts
    assert json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["ignore"] == [
        "lm_head", "model.embed_tokens", ROUTER
    ]  # fmt: skip
