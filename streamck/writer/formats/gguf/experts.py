"""Per-expert tensors stacked per layer as ``convert_hf_to_gguf.py`` stacks them, without
reading a byte: a stacked [E, rows, cols] tensor is its experts' source references one after
another (streamck.source.select ``concat``), so the writer reads it one expert, and within an
expert one chunk, at a time; the reference holds the whole stack (``torch.stack``).

Where a stacked tensor lands in the file is the reference's too: it buffers a layer's expert
tensors as it meets them and, once it holds all ``len(projs)`` x E of them, yields each
projection's stack, in the family's order, at the place of the last one met.
"""

from __future__ import annotations

from collections import defaultdict

from streamck.errors import PlanError
from streamck.plan import OutputTensor
from streamck.source.select import concat
from streamck.writer.formats.gguf.table import Experts


class Stacker:
    """The reference's per-layer expert buffer for one model: ``take`` each tensor in the
    reference's order; ``finish`` once all are taken."""

    def __init__(self, spec: Experts, count: int):
        self.spec, self.count = spec, count
        self.held: dict[int, dict[str, OutputTensor]] = defaultdict(dict)

    def expert_of(self, name: str) -> tuple[int, int, str] | None:
        """(layer, expert, projection) of a per-expert tensor of this family, else None;
        PlanError for another tensor under the layer's experts."""
        head, sep, tail = name.partition(f".{self.spec.block}.experts.")
        layer = head.removeprefix("model.layers.")
        if not sep:
            return None
        parts = tail.split(".")
        if not (layer.isdecimal() and len(parts) == 3 and parts[0].isdecimal() and parts[1] in self.spec.projs):
            raise PlanError(f"tensor {name}: GGUF output stacks only experts.N.{{{','.join(self.spec.projs)}}}.weight")
        if parts[2] != "weight":
            raise PlanError(f"tensor {name}: GGUF output stacks expert weights only")
        return int(layer), int(parts[0]), parts[1]

    def take(self, t: OutputTensor) -> list[OutputTensor] | None:
        """None where ``t`` is no expert tensor; else the stacked tensors it completes (under
        their Hugging Face-side names), none until its layer's last expert tensor."""
        found = self.expert_of(t.name)
        if found is None:
            return None
        layer, expert, _ = found
        if expert >= self.count:
            raise PlanError(f"tensor {t.name}: expert {expert}, but config.json says {self.count} experts")
        held = self.held[layer]
        held[t.name] = t
        if len(held) < self.count * len(self.spec.projs):
            return []
        return [self._stack(layer, proj, [held.pop(self._name(layer, e, proj)) for e in range(self.count)])
                for proj in self.spec.projs]  # fmt: skip

    def _name(self, layer: int, expert: int, proj: str) -> str:
        return f"model.layers.{layer}.{self.spec.block}.experts.{expert}.{proj}.weight"

    def _stack(self, layer: int, proj: str, experts: list[OutputTensor]) -> OutputTensor:
        """``experts`` as one [E, …] tensor; PlanError where they do not stack."""
        name = self.spec.stacked.format(bid=layer, proj=proj)
        try:
            ref = concat(name, [t.source for t in experts])
        except ValueError as e:  # dtypes or shapes of the experts disagree
            raise PlanError(f"layer {layer}'s experts: {e}") from None
        first = experts[0]
        computed = next((t for t in experts if t.transform is not None), None)
        if computed is not None:
            raise PlanError(
                f"{computed.name} is computed ({computed.transform.label}): GGUF output reads stored tensors only, yet"
            )
        return OutputTensor(name, ref._replace(shape=(self.count, *first.source.shape)), first.dtype)

    def finish(self) -> None:
        """PlanError naming an expert tensor whose layer never had all of them (the reference's
        "Unprocessed experts")."""
        left = sorted(n for held in self.held.values() for n in held)
        if left:
            layer = self.held[self.expert_of(left[0])[0]]
            need = self.count * len(self.spec.projs)
            raise PlanError(f"experts missing: {left[0]}'s layer has {len(layer)} of its {need} expert tensors")
