"""torch DCP saves to one safetensors file: a 2-rank save of DTensors (sharded safetensors and
.distcp) against torch's consolidators, and a blob saved as a transposed view."""

from __future__ import annotations

import argparse
import math
import os
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
    streamck,
    table,
)


@case(size="2GiB")
def case_dcp(a: argparse.Namespace, tmp: Path) -> str:
    """torch DCP checkpoint (2 gloo ranks) -> one safetensors file: torch's consolidators vs streamck."""
    from dcp_ckpt import make_dcps, plan

    size = parse_size(a.size)
    big, small = make_dcps([(tmp / "big", size), (tmp / "small", size // 4)])
    hf, distcp = big["hf"], big["dcp"]
    data = dir_bytes(hf)
    tensors = plan(size)
    largest = max(tensors, key=lambda t: math.prod(t[1]) * (4 if t[2] == "f32" else 2))
    largest_bytes = math.prod(largest[1]) * (4 if largest[2] == "f32" else 2)
    kinds = {p: sum(1 for t in tensors if t[3] == p) for p in ("S0", "S1", "R")}
    consolidate = str(HERE / "dcp_consolidate.py")
    contenders = {
        "cp -r + sync (sharded safetensors)": cp_fsync(hf),
        "torch consolidate_safetensors_files": lambda o: [PY, consolidate, "hf", str(hf), str(o)],
        "torch dcp_to_torch_save (.distcp)": lambda o: [PY, consolidate, "distcp", str(distcp), str(o)],
        "streamck rewrite (sharded safetensors)": lambda o: streamck("rewrite", str(hf), "-o", str(o), "-q"),
        "streamck rewrite (.distcp)": lambda o: streamck("rewrite", str(distcp), "-o", str(o), "-q"),
    }
    out = tmp / "out"
    runs = contend(contenders, out, a.reps, a.settle, (hf, distcp))
    s_hf = peak_at(streamck("rewrite", str(small["hf"]), "-o", str(out), "-q"), out, a.settle)
    s_dcp = peak_at(streamck("rewrite", str(small["dcp"]), "-o", str(out), "-q"), out, a.settle)
    return (
        f"Checkpoint: {len(tensors)} tensors ({kinds['S0']} Shard(0), {kinds['S1']} Shard(1), {kinds['R']} "
        f"replicated; BF16 and F32) as DTensors on 2 gloo ranks, saved by torch's `HuggingFaceStorageWriter("
        f"save_distributed=True)` ({data / 2**30:.2f} GiB in 2 shards) and `FileSystemWriter` "
        f"({dir_bytes(distcp) / 2**30:.2f} GiB .distcp); largest tensor `{largest[0]}` "
        f"{largest_bytes / 2**20:.0f} MiB. Output: one file. {a.reps} interleaved reps, {a.settle:.0f} s settle.\n\n"
        + table(runs, "cp -r + sync (sharded safetensors)", data)
        + f"\n\nstreamck peak RSS as the checkpoint grows: {mib(s_hf)} (sharded safetensors) and {mib(s_dcp)} "
        f"(.distcp) at {dir_bytes(small['hf']) / 2**30:.2f} GiB vs "
        f"{mib(runs['streamck rewrite (sharded safetensors)'].peak)} and "
        f"{mib(runs['streamck rewrite (.distcp)'].peak)} at {data / 2**30:.2f} GiB."
        + chart(a, runs, "dcp", f"consolidating a {data / 2**30:.1f} GiB DCP checkpoint: RSS over time")
    )


@case
def case_dcpview(a: argparse.Namespace, tmp: Path) -> str:
    """A DCP save whose blob is a transposed view (--embed bytes): gathered as a .pt view is."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    side = int((parse_size(a.embed) // 4) ** 0.5)
    src = tmp / "dcp"
    with warnings.catch_warnings():  # no_dist: "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore")
        state = {"w": torch.empty(side, side).normal_().t()}
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(src)), no_dist=True)
    os.sync()
    data = dir_bytes(src)
    consolidate = str(HERE / "dcp_consolidate.py")
    contenders = {
        "cp -r + sync": cp_fsync(src),
        "torch dcp_to_torch_save": lambda o: [PY, consolidate, "distcp", str(src), str(o)],
        "streamck rewrite": lambda o: streamck("rewrite", str(src), "-o", str(o), "-q"),
    }
    runs = contend(contenders, tmp / "out.safetensors", a.reps, a.settle, (src,))
    return (
        f"Source: `dcp.save` of a {side}×{side} F32 matrix saved transposed ({data / 2**30:.2f} GiB .distcp, "
        f"strides (1, {side})); each output row takes one element of every source row. {a.reps} interleaved "
        f"reps, {a.settle:.0f} s settle.\n\n" + table(runs, "cp -r + sync", data)
    )
