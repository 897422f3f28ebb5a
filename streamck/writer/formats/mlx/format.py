"""MLX (mlx-lm on Apple silicon): the folder ``mlx_lm.convert --hf-path SRC --mlx-path OUT`` writes.

Safetensors files (``model.safetensors``, or ``model-0000K-of-0000N.safetensors`` cut at 5 GiB
in MLX's parameter order, ``{"format": "mlx"}`` in each header), always with
``model.safetensors.index.json`` (4-space indents, the total size and the parameter count),
``config.json`` as ``save_config`` writes it, the tokenizer's files, generation_config.json and
the model card. The tensors are the plan pass's (streamck.writer.formats.mlx.plan).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from streamck.errors import PlanError, UsageError
from streamck.fileio import write_all
from streamck.plan import OutputTensor, Plan
from streamck.writer.formats.base import Format, TensorBytes
from streamck.writer.formats.mlx import table
from streamck.writer.formats.mlx.plan import Prepared, prepare
from streamck.writer.layout import INDEX_NAME, SINGLE_NAME, Shard, header_bytes

if TYPE_CHECKING:
    from streamck.writer.options import WriteOptions


class MLX(Format):
    """MLX output. Its types are ``options.outtype``: ``--dtype`` (bf16, f16, f32) or a
    ``--quantize`` scheme (``mlx_q4``, ``mlx_q8``, ``mlx_mxfp4``, ``mlx_nvfp4``, ``mlx_mxfp8``: table.SCHEMES),
    with ``options.group_size``."""

    name = "mlx"
    title = "an MLX model"
    single_name = SINGLE_NAME
    verifies = False
    quantizes = tuple(s.upper() for s in table.SCHEMES)
    owns_types = True
    own_schemes_only = True  # --quantize is one of its schemes, never the plan's (compressed-tensors)

    def __init__(self) -> None:
        self.prepared: Prepared | None = None

    def prepare(self, plan: Plan, options: WriteOptions) -> Plan:
        mlx_plan, self.prepared = prepare(plan, options.outtype, options.group_size)
        return mlx_plan

    def check(self, plan: Plan, options: WriteOptions, target: Path | str) -> None:
        super().check(plan, options, target)
        if options.keep_shards:
            raise UsageError("{keep_shards} keeps the source's files; MLX output is cut as mlx_lm cuts it")
        if str(target).endswith(".safetensors"):
            raise UsageError("MLX output is a folder; give a directory, not a .safetensors file")

    def layout(self, plan: Plan, filename: str, options: WriteOptions) -> list[Shard]:
        groups = make_shards(plan.tensors, options.max_shard_size or table.MAX_SHARD)
        n = len(groups)
        names = [SINGLE_NAME] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        return [
            Shard(name, header_bytes(group, plan.metadata), group) for name, group in zip(names, groups, strict=True)
        ]

    def write(self, shard: Shard, tensors: TensorBytes, out: int) -> None:
        write_all(out, shard.header)
        tensors.copy(shard.tensors, out)

    def extras(self, plan: Plan, shards: list[Shard]) -> dict[str, Path | bytes]:
        if self.prepared is None:
            raise PlanError("MLX: extras() before prepare()")
        config = json.dumps(self.prepared.config, indent=4).encode()
        return {**self.prepared.files, "config.json": config, INDEX_NAME: index_bytes(shards, self.prepared.parameters)}


def make_shards(tensors: list[OutputTensor], max_size: int) -> list[list[OutputTensor]]:
    """``mlx_lm.utils.make_shards``: in order, a new shard where the next tensor would pass
    ``max_size`` bytes (a larger tensor alone)."""
    groups: list[list[OutputTensor]] = []
    size = 0
    for t in tensors:
        if not groups or size + t.nbytes > max_size:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    return groups


def index_bytes(shards: list[Shard], parameters: int) -> bytes:
    """``save_model``'s index: the total size, the parameter count, the weight map by name."""
    weight_map = {t.name: s.filename for s in shards for t in s.tensors}
    index = {
        "metadata": {"total_size": sum(t.nbytes for s in shards for t in s.tensors), "total_parameters": parameters},
        "weight_map": dict(sorted(weight_map.items())),
    }
    return json.dumps(index, indent=4).encode()
