"""Trainers' checkpoints against the trainers' own merge tools, the outputs checked equal bit for bit:
accelerate merge-weights (Trainer + FSDP2), dcp_to_torch_save + save_pretrained (a Qwen3-MoE FSDP2
save, per-expert output), verl's model_merger (a verl FSDP2 actor)."""

from __future__ import annotations

import argparse
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
    same_tensors,
    streamck,
    table,
)


@case(size="2GiB")
def case_fsdp(a: argparse.Namespace, tmp: Path) -> str:
    """Trainer + FSDP2 checkpoint-N (SHARDED_STATE_DICT, 2 ranks) -> safetensors: merge-weights vs streamck."""
    from fsdp_ckpt import make_fsdp

    size = parse_size(a.size)
    ck, small = make_fsdp(tmp / "big", size), make_fsdp(tmp / "small", size // 4)
    model = ck / "pytorch_model_fsdp_0"
    data = dir_bytes(model)
    merge = str(Path(PY).with_name("accelerate"))
    contenders = {
        "cp -r + sync (pytorch_model_fsdp_0)": cp_fsync(model),
        # merge_fsdp_weights: loads the whole state dict, then saves it; fsync as the others do
        "accelerate merge-weights": lambda o: ["sh", "-c", f'"{merge}" merge-weights "{model}" "{o}" && sync "{o}"/*'],
        "streamck rewrite checkpoint-N": lambda o: streamck("rewrite", str(ck), "-o", str(o), "-q"),
        "accelerate merge-weights --help (its start-up alone)": lambda o: [merge, "merge-weights", "--help"],
    }
    out = tmp / "out"
    runs = contend(contenders, out, a.reps, a.settle, (model,))
    same_tensors(contenders, {"accelerate merge-weights": tmp / "m", "streamck rewrite checkpoint-N": tmp / "s"})
    s_small = peak_at(streamck("rewrite", str(small), "-o", str(out), "-q"), out, a.settle)
    return (
        f"Checkpoint: `checkpoint-1/pytorch_model_fsdp_0/` as accelerate's `save_fsdp_model` writes it "
        f'(DCP of {{"model": get_model_state_dict(...)}}) from a Llama sharded by FSDP2 `fully_shard` '
        f"on 2 gloo ranks, F32, {data / 2**30:.2f} GiB in 2 .distcp files (bench/fsdp_ckpt.py). Output: a "
        "directory with model.safetensors, the same tensors bit for bit from both tools (`streamck diff --data`). "
        f"{a.reps} interleaved reps, {a.settle:.0f} s settle.\n\n"
        + table(runs, "cp -r + sync (pytorch_model_fsdp_0)", data)
        + f"\n\nstreamck peak RSS as the checkpoint grows: {mib(s_small)} at "
        f"{dir_bytes(small / 'pytorch_model_fsdp_0') / 2**30:.2f} GiB "
        f"vs {mib(runs['streamck rewrite checkpoint-N'].peak)} at {data / 2**30:.2f} GiB."
        + chart(a, runs, "fsdp", f"merging a {data / 2**30:.1f} GiB FSDP checkpoint: RSS over time")
    )


@case
def case_moe(a: argparse.Namespace, tmp: Path) -> str:
    """FSDP2 dcp.save of a Qwen3-MoE (fused experts) -> per-expert HF: load + save_pretrained vs streamck."""
    from moe_ckpt import make_moe

    big, small = make_moe(tmp / "big", 16), make_moe(tmp / "small", 4)
    data = dir_bytes(big)
    script = str(HERE / "moe_ckpt.py")
    contenders = {
        "cp -r + sync (the DCP save)": cp_fsync(big),
        "dcp_to_torch_save + load_state_dict + save_pretrained": lambda o: [PY, script, "route", str(big), str(o)],
        "streamck rewrite (per expert)": lambda o: streamck("rewrite", str(big), "-o", str(o), "-q"),
    }
    out = tmp / "out"
    runs = contend(contenders, out, a.reps, a.settle, (big,))
    route, ours = "dcp_to_torch_save + load_state_dict + save_pretrained", "streamck rewrite (per expert)"
    same_tensors(contenders, {route: tmp / "r", ours: tmp / "s"})
    s_small = peak_at(streamck("rewrite", str(small), "-o", str(out), "-q"), out, a.settle)
    fused = 16 * 4096 * 2048 * 4
    return (
        f"Checkpoint: `dcp.save(model.state_dict())` of a transformers Qwen3-MoE (2 layers, hidden 2048, 16 "
        f"experts of hidden 2048, F32) sharded by FSDP2 `fully_shard` on 2 gloo ranks, {data / 2**30:.2f} GiB in "
        f"2 .distcp files, `config.json` beside (bench/moe_ckpt.py); each `experts.gate_up_proj` "
        f"{fused / 2**20:.0f} MiB, each `experts.down_proj` {fused / 2**21:.0f} MiB. Output: a directory with "
        "model.safetensors holding per-expert tensors as save_pretrained names them, the same tensors bit for bit "
        f"from both tools (`streamck diff --data`). {a.reps} interleaved reps, {a.settle:.0f} s settle.\n\n"
        + table(runs, "cp -r + sync (the DCP save)", data)
        + f"\n\nstreamck peak RSS as the fused tensors grow: {mib(s_small)} with 4 experts "
        f"(gate_up_proj {fused / 4 / 2**20:.0f} MiB, {dir_bytes(small) / 2**30:.2f} GiB) vs "
        f"{mib(runs['streamck rewrite (per expert)'].peak)} with 16 ({fused / 2**20:.0f} MiB, {data / 2**30:.2f} GiB)."
        + chart(a, runs, "moe", f"per-expert export of a {data / 2**30:.1f} GiB MoE FSDP2 save: RSS over time")
    )


@case(size="1GiB")
def case_verl(a: argparse.Namespace, tmp: Path) -> str:
    """verl 0.9.1 FSDP2 actor (2 ranks) -> safetensors bf16: verl's model_merger vs streamck vs cp -r."""
    from verl_ckpt import VERL_PYTHON, make_verl

    actor = make_verl(tmp / "big", parse_size(a.size))
    data = sum(p.stat().st_size for p in actor.glob("model_world_size_*.pt"))
    merger = f'"{VERL_PYTHON}" -m verl.model_merger merge --backend fsdp --local_dir "{actor}" --target_dir'
    contenders = {
        "cp -r + sync (actor/)": cp_fsync(actor),
        # verl's merger torch.loads every rank file whole and always casts to bf16; fsync as the others do
        "verl model_merger merge --backend fsdp": lambda o: ["sh", "-c", f'{merger} "{o}" >/dev/null && sync "{o}"/*'],
        "streamck rewrite actor/ --dtype bf16": lambda o: streamck(
            "rewrite", str(actor), "-o", str(o), "--dtype", "bf16", "-q"
        ),
    }
    out = tmp / "out"
    runs = contend(contenders, out, a.reps, a.settle, (actor,))
    same_tensors(
        contenders,
        {"verl model_merger merge --backend fsdp": tmp / "m", "streamck rewrite actor/ --dtype bf16": tmp / "s"},
    )
    return (
        f"Checkpoint: `global_step_1/actor/` as verl 0.9.1's `FSDPCheckpointManager` writes it (verl's FSDP2 engine, "
        f"2 gloo ranks, one training step; bench/verl_ckpt.py), an untied Llama, F32, {data / 2**30:.2f} GiB in 2 "
        "model rank files (optimizer files beside them, not read). Output: bf16 model.safetensors + config, the same "
        f"tensors bit for bit from both tools (`streamck diff --data`). {a.reps} interleaved reps, {a.settle:.0f} s "
        "settle.\n\n" + table(runs, "cp -r + sync (actor/)", data)
    )
