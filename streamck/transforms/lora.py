"""A PEFT LoRA merge as a transform: what is merged (``LoraMerge``, made by streamck.plan.lora.plan)
and the blocks both engines compute it in. Each engine is a subclass that computes it:
``TorchMerge`` (lora_torch, PEFT's bits) and ``NumpyMerge`` (lora_np, no torch).

The blocks depend on the tensor's shape only (merge_blocks), never on a writer's chunk:
``--verify`` computes a merge again in the same blocks, so it gets the same bits.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise
from typing import ClassVar

from streamck.source.header import TensorRef

BLOCK_ROWS = 16
# fp32 bytes of W per block: W, the delta and their sum are each about this much.
MERGE_CHUNK = 4 << 20


def row_blocks(rows: int, row_bytes: int, chunk: int) -> list[tuple[int, int]]:
    """[start, end) row ranges of about ``chunk`` bytes (``row_bytes`` each row in fp32), each
    a multiple of BLOCK_ROWS rows but the last, which is at least BLOCK_ROWS rows or all."""
    step = max(BLOCK_ROWS, chunk // max(row_bytes, 1) // BLOCK_ROWS * BLOCK_ROWS)
    edges = [*range(0, rows, step), rows]
    if len(edges) > 2 and edges[-1] - edges[-2] < BLOCK_ROWS:
        del edges[-2]
    return list(pairwise(edges))


def merge_blocks(rows: int, cols: int) -> list[tuple[int, int]]:
    """The row blocks every merge of a (rows, cols) tensor is computed in, by either engine."""
    return row_blocks(rows, cols * 4, MERGE_CHUNK)


def copy_blocks(ref: TensorRef) -> Iterator[tuple[int, int]]:
    """(elements, bytes) of each block a saved copy is read in: merge_blocks over its first axis."""
    rows = ref.shape[0] if ref.shape else 1
    cols = ref.numel // rows if rows else 0
    size = ref.nbytes // max(ref.numel, 1)
    for start, end in merge_blocks(rows, cols):
        yield (end - start) * cols, (end - start) * cols * size


@dataclass(frozen=True, slots=True)
class LoraMerge:
    """How an output tensor is computed from its source W (PEFT's order, fp32 throughout):

    - ``linear``: W + B[rows] @ A * scale (or ``(B @ A[:, rows])^T * scale`` when ``transposed``:
      an embedding, or ``fan_in_fan_out``), rounded once to W's dtype; with ``round_delta``
      (embeddings, safe_merge) the delta is rounded to W's dtype before the add;
      with ``magnitude`` (DoRA) the sum S is scaled per row by magnitude / ‖S‖₂;
    - ``bias``: W + b * scale, ``b`` being lora_B's bias (``a`` is None);
    - ``copy``: ``b`` (a saved copy) rounded to W's dtype, as PEFT loads it into the base's
      module, then cast to the output dtype (only where both roundings change it).
    """

    kind: str
    b: TensorRef
    a: TensorRef | None = None
    scale: float = 1.0
    transposed: bool = False
    round_delta: bool = False
    magnitude: TensorRef | None = None
    safe: bool = False
    engine: ClassVar[str] = ""  # set by each engine's subclass
    exact: ClassVar[bool] = False

    @property
    def label(self) -> str:
        return "" if self.kind == "copy" else "+LoRA"

    def inputs(self) -> tuple[TensorRef, ...]:
        return tuple(r for r in (self.b, self.a, self.magnitude) if r is not None)

    def origin(self, source: TensorRef) -> TensorRef:
        return self.b if self.kind == "copy" else source  # a saved copy's bytes are the adapter's
