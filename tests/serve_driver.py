"""Loads quantized checkpoints as a user serving them with transformers does, in one child (one
import of transformers + compressed-tensors for every job), and reports what it saw as JSON:

    serve_driver.py RESULTS.json JOBS.json

Each job is ``{"name", "base", "out", "how"}``: ``how`` "transformers" is ``from_pretrained(out)``
(compressed-tensors decompressing on load, the dtype from config.json); "decompress" runs
compressed-tensors' own compressor (the config's format) on each quantized module's stored
tensors and loads the result, saved beside ``base``'s config, with from_pretrained (transformers'
expert converters fuse it, with no quantization to handle). Each result: missing / unexpected / mismatched keys,
the logits' relative error and cosine against ``base``'s (loaded in its own dtype), whether the
input embeddings and the head equal ``base``'s, how many Linear modules hold quantized weights,
or the error's last line.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch

IDS = (torch.arange(64).reshape(2, 32) * 7) % 512


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits.float()


def quantized_modules(model) -> int:
    """Modules that hold quantized weights once loaded (FP8 weights, or packed FP4 ones)."""
    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        packed = getattr(module, "weight_packed", None) is not None
        if packed or (weight is not None and weight.dtype in (torch.float8_e4m3fn, torch.uint8)):
            count += 1
    return count


def decompressed(base: str, out: str):
    """``base``'s model with every quantized module of ``out`` decompressed by compressed-tensors'
    compressor for the config's format and the other tensors as ``out`` stores them."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    qc = json.loads((Path(out) / "config.json").read_text())["quantization_config"]
    (group,) = qc["config_groups"].values()
    scheme = QuantizationScheme(**group)
    compressor = BaseCompressor.get_value_from_registry(group.get("format") or qc["format"])
    stored = {k: v for f in sorted(Path(out).glob("*.safetensors")) for k, v in load_file(f).items()}
    modules: dict[str, dict] = {}
    for name, value in stored.items():
        module, _, local = name.rpartition(".")
        modules.setdefault(module, {})[local] = value
    weights = {}
    for module, local in modules.items():
        if "weight_scale" in local:  # the decompressed weight only (the result keeps the scales beside it)
            local = {"weight": compressor.decompress(local, scheme)["weight"]}
        weights.update({f"{module}.{k}": v for k, v in local.items()})
    # Saved beside base's config and loaded by from_pretrained: its converters fuse per-expert weights.
    dense = Path(f"{out}-decompressed")
    dense.mkdir()
    shutil.copy(Path(base) / "config.json", dense)
    dtype = json.loads((dense / "config.json").read_text())["dtype"]
    save_file({k: v.to(getattr(torch, dtype)).contiguous() for k, v in weights.items()}, dense / "model.safetensors")
    return AutoModelForCausalLM.from_pretrained(dense, output_loading_info=True)


def run(job: dict) -> dict:
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(job["base"])
    want = logits(base)
    try:
        if job["how"] == "transformers":
            model, info = AutoModelForCausalLM.from_pretrained(job["out"], output_loading_info=True)
        else:
            model, info = decompressed(job["base"], job["out"])
        count = quantized_modules(model) if job["how"] == "transformers" else None
        got = logits(model)
    except Exception as e:  # what the user sees, reported for the test to judge
        return {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[-1]}"}
    same = {
        part: bool(torch.equal(getattr(model, fn)().weight.float(), getattr(base, fn)().weight.float()))
        for part, fn in (("embeddings", "get_input_embeddings"), ("head", "get_output_embeddings"))
    }
    return {
        "error": None,
        "keys": {k: sorted(map(str, v)) for k, v in info.items() if k != "error_msgs" and v},
        "rel": float((got - want).norm() / want.norm()),
        "cos": float(torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), 0)),
        "same": same,
        "quantized": count,
        "dtype": str(next(model.parameters()).dtype),
    }


if __name__ == "__main__":
    jobs = json.loads(Path(sys.argv[2]).read_text())
    Path(sys.argv[1]).write_text(json.dumps({job["name"]: run(job) for job in jobs}, indent=1))
