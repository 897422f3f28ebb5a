"""Real torch.distributed.checkpoint (DCP) checkpoints, written by torch's own writers.

``make_dcp_checkpoints(root)`` runs two CPU processes on gloo, builds DTensors on a
2-rank DeviceMesh and saves one state in three layouts:

* ``hf/``: torch's ``HuggingFaceStorageWriter(save_distributed=True)``: one
  ``shard-0000{rank+1}-model-00001-of-00001.safetensors`` per rank, each chunk a
  safetensors tensor, ``__metadata__["DCP_SHARDING_INFO"]`` giving its offsets.
* ``dcp/``: native DCP (``FileSystemWriter``): ``.metadata`` + ``__{rank}_0.distcp``.
* ``run/epoch_0_step_10/model/``: the NeMo-Automodel layout (its
  ``_HuggingFaceStorageWriter(save_sharded=True)``, whose safetensors files list and
  store the chunks in plan order), plus ``.hf_metadata/config.json`` and
  ``fqn_to_file_index_mapping.json``.

The full tensors go to ``reference.safetensors`` (safetensors' own ``save_file``).
"""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from dcp_ckpt import WORLD, spawn_ranks  # 2 ranks, launched as the bench's DCP saves are

STEP = 10


VOCAB, HIDDEN = 101, 48


def full_state() -> dict[str, torch.Tensor]:
    """The unsharded tensors, by flattened DCP name; the same on every rank."""
    g = torch.Generator().manual_seed(1234)

    def rnd(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype)

    return {
        "model.shard0": rnd(64, 48),  # Shard(0), even
        "model.shard1_bf16": rnd(40, 66, dtype=torch.bfloat16),  # Shard(1)
        "model.replicated": rnd(12, 10),  # Replicate: one rank saves it
        "model.uneven": rnd(1001, 3),  # Shard(0), 501 + 500 rows
        "model.vec": rnd(37),  # 1-D Shard(0): 19 + 18
        "model.cube_bf16": rnd(4, 6, 5, dtype=torch.bfloat16),  # 3-D Shard(1)
        "model.layers.0.norm.weight": rnd(48, dtype=torch.bfloat16),  # deep nesting, Replicate
        "model.embed_tokens.weight": rnd(VOCAB, HIDDEN),  # Shard(0), 51 + 50 rows: config.json fixes its shape
        "extra.w": rnd(5, 7),  # a plain torch.Tensor, not a DTensor
    }


def _placements():
    from torch.distributed.tensor import Replicate, Shard

    return {
        "model.shard0": Shard(0),
        "model.shard1_bf16": Shard(1),
        "model.replicated": Replicate(),
        "model.uneven": Shard(0),
        "model.vec": Shard(0),
        "model.cube_bf16": Shard(1),
        "model.layers.0.norm.weight": Replicate(),
        "model.embed_tokens.weight": Shard(0),
    }


def _nested(flat: dict) -> dict:
    """``{"a.b.c": v}`` -> ``{"a": {"b": {"c": v}}}``: the shape torchtitan hands to dcp.save."""
    out: dict = {}
    for name, value in flat.items():
        *parents, leaf = name.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def _automodel_writer_class():
    """torch's HuggingFaceStorageWriter, writing each rank's file the way NeMo-Automodel does.

    Ported from NVIDIA-NeMo/Automodel ``nemo_automodel/components/checkpoint/_backports/
    filesystem.py`` ``_write_files_from_queue`` (SAFETENSORS branch, commit 36044ad3): the
    header is ``json.dumps(..., separators=(",", ":"))`` of the chunks in plan order, then
    ``__metadata__`` last, padded with spaces to 8 bytes; the data follow in the same order.
    torch's own writer instead calls ``safetensors.torch.save`` (dtype-then-name order).
    """
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint._hf_utils import _gen_file_name
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future

    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64"}

    class AutomodelWriter(HuggingFaceStorageWriter):
        def write_data(self, plan, planner):
            # Automodel's prepare_global_plan drops fqn_to_index_mapping: one file per rank.
            storage_key = _gen_file_name(1, 1, plan.storage_data["shard_index"])
            path = os.path.join(self.path, storage_key)
            results = []
            for items in [plan.items] if plan.items else []:
                if any(wi.type == WriteItemType.BYTE_IO for wi in items):
                    raise RuntimeError("Cannot serialize BYTE_IO items in safetensors format.")
                header, sizes, offset = {}, [], 0
                for wi in items:
                    n = wi.tensor_data.chunk.sizes.numel() * wi.tensor_data.properties.dtype.itemsize
                    header[wi.index.fqn] = {
                        "dtype": names[wi.tensor_data.properties.dtype],
                        "shape": [int(s) for s in wi.tensor_data.chunk.sizes],
                        "data_offsets": [offset, offset + n],
                    }
                    sizes.append(n)
                    offset += n
                header["__metadata__"] = {
                    "DCP_SHARDING_INFO": json.dumps(
                        {wi.index.fqn: {"saved_offsets": wi.tensor_data.chunk.offsets} for wi in items}
                    ),
                    "DCP_VERSION": "1.0",
                    "format": "pt",
                }
                raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
                raw += b" " * ((8 - len(raw) % 8) % 8)
                with open(path, "wb") as f:
                    f.write(struct.pack("<Q", len(raw)) + raw)
                    start = 8 + len(raw)
                    for wi, n in zip(items, sizes, strict=True):
                        t = planner.resolve_data(wi).detach().cpu().contiguous().clone()
                        t = t.reshape(1) if t.dim() == 0 else t
                        f.write(t.view(torch.uint8).numpy().tobytes())
                        info = _StorageInfo(storage_key, start, n)
                        results.append(WriteResult(index=wi.index, size_in_bytes=n, storage_data=info))
                        start += n
            fut = Future()
            fut.set_result(results)
            return fut

    return AutomodelWriter


def _worker(rank: int, root: str, store_path: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        full = full_state()
        places = _placements()
        flat = {k: distribute_tensor(v, mesh, [places[k]]) if k in places else v.clone() for k, v in full.items()}
        state = _nested(flat)
        state["step"] = STEP  # a non-tensor item: BytesStorageMetadata in DCP
        base = Path(root)

        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(base / "dcp")))
        # torch's HF writer puts a non-tensor item's bytes at the start of the safetensors
        # stream (filesystem.py _write_files_from_queue), breaking the file: tensors only.
        tensors_only = {k: v for k, v in state.items() if k != "step"}
        dcp.save(tensors_only, storage_writer=dcp.HuggingFaceStorageWriter(str(base / "hf"), save_distributed=True))

        model_dir = base / "run" / f"epoch_0_step_{STEP}" / "model"
        if rank == 0:  # Automodel's rank 0 writes .hf_metadata before the save (addons.py pre_save)
            meta = model_dir / ".hf_metadata"
            meta.mkdir(parents=True, exist_ok=True)
            config = {
                "architectures": ["TinyForCausalLM"],
                "model_type": "tiny",
                "torch_dtype": "bfloat16",
                "vocab_size": VOCAB,
                "hidden_size": HIDDEN,
            }
            (meta / "config.json").write_text(json.dumps(config, indent=2))
            with open(meta / "fqn_to_file_index_mapping.json", "w") as f:
                json.dump(dict.fromkeys(full, 1), f, indent=2, sort_keys=True)
        dist.barrier()
        # Automodel passes the model's flat (HF-named) state dict, no step counter.
        dcp.save(flat, storage_writer=_automodel_writer_class()(str(model_dir), save_distributed=True))
    finally:
        dist.destroy_process_group()


def make_dcp_checkpoints(root: Path) -> dict:
    """Write the three checkpoints and the reference under ``root``; return their paths.

    Keys: ``hf`` (list of shard files), ``dcp`` (directory), ``automodel`` (list of shard
    files), ``automodel_dir`` (the step's ``model/``), ``run`` (the run root), ``reference``
    (the full tensors' safetensors file), ``tensors`` (name -> full tensor), ``step``.
    """
    from safetensors.torch import save_file

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    spawn_ranks(_worker, (str(root),), root / "filestore")  # bench/dcp_ckpt.py's launch of the 2 ranks
    tensors = full_state()
    save_file(tensors, root / "reference.safetensors")
    model_dir = root / "run" / f"epoch_0_step_{STEP}" / "model"
    return {
        "hf": sorted((root / "hf").glob("*.safetensors")),
        "dcp": root / "dcp",
        "automodel": sorted(model_dir.glob("*.safetensors")),
        "automodel_dir": model_dir,
        "run": root / "run",
        "reference": root / "reference.safetensors",
        "tensors": tensors,
        "step": STEP,
    }


if __name__ == "__main__":  # python tests/dcp_fixtures.py OUT_DIR
    import time

    t0 = time.time()
    out = make_dcp_checkpoints(Path(sys.argv[1]))
    print({k: v for k, v in out.items() if k != "tensors"}, f"{time.time() - t0:.1f}s")
