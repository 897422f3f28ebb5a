"""One Hugging Face MoE family's expert layout, as data: ``Family`` (the table of them is
streamck.plan.moe.families).

transformers 5 keeps a layer's routed experts fused while it runs: ``<block>.experts.gate_up_proj``
[E, 2I, H] (expert e's gate rows first, then its up rows) and ``<block>.experts.down_proj``
[E, H, I]. ``save_pretrained`` reverts the family's entry of ``transformers/conversion_mapping.py``
(a ``MergeModulelist`` + ``Concatenate(dim=1)`` for gate/up, ``MergeModulelist`` for down, and
renames), so per-expert families write ``<disk block>.experts.e.<gate>.weight`` =
``gate_up_proj[e, :I]``, ``….<up>.weight`` = ``gate_up_proj[e, I:]`` and ``….<down>.weight`` =
``down_proj[e]``. Families whose checkpoints hold fused tensors write them as they run, under
their runtime names or renamed (Granite-MoE's ``input_linear.weight``).
"""

from __future__ import annotations

from dataclasses import dataclass

# The config keys that give the routed expert count, by family (the first one present wins).
COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
# The runtime names of a block's fused experts (after ``<block>.experts.``).
GATE_UP, DOWN = "gate_up_proj", "down_proj"


@dataclass(frozen=True)
class Family:
    """One family's expert layout.

    ``block`` is the module holding ``experts`` at run time (``mlp``, ``feed_forward``,
    ``block_sparse_moe``; empty where the decoder layer holds them itself, Gemma 4, which then
    writes them as they run) and ``disk_block`` its name in ``save_pretrained``'s files; every
    tensor under an MoE block takes ``disk_block`` there. ``experts`` are the per-expert disk
    names of gate, up and down (``gate_proj``/``up_proj``/``down_proj``, Mixtral's
    ``w1``/``w3``/``w2``), or None where the file keeps them fused. ``renames`` map a suffix
    under the runtime block to its disk suffix (a router, or fused experts, that the file names
    otherwise). ``router`` is the runtime suffix of the router's weight, [E + extra, H], the
    extra rows the sum of ``router_extra``: config keys (Inkling's shared experts) or numbers
    (Zaya's no-op expert). ``names``
    are substrings of any tensor name that save_pretrained writes otherwise (runtime, disk).
    ``gate_up_extra``: the fused gate/up has rows for the router's extra experts too, down has
    not (LongCat's zero experts; save_pretrained writes their gate and up). ``fp32`` are
    transformers' ``_keep_in_fp32_modules_strict`` patterns (kept in float32 under
    a bf16 or fp16 load), ``fp32_fp16`` its ``_keep_in_fp32_modules`` (under fp16 only).
    """

    block: str
    disk_block: str
    experts: tuple[str, str, str] | None
    router: str
    renames: tuple[tuple[str, str], ...] = ()
    router_extra: tuple[str | int, ...] = ()
    names: tuple[tuple[str, str], ...] = ()
    fp32: tuple[str, ...] = ()
    fp32_fp16: tuple[str, ...] = ()
    gate_up_extra: bool = False

    @property
    def per_expert(self) -> bool:
        return self.experts is not None

    def disk_suffix(self, suffix: str) -> str:
        """The disk name of a tensor ``<block>.<suffix>`` of an MoE block, after ``<disk_block>.``."""
        return dict(self.renames).get(suffix, suffix)

    def runtime_suffix(self, suffix: str) -> str:
        """The inverse of disk_suffix."""
        return {disk: run for run, disk in self.renames}.get(suffix, suffix)

    def disk_name(self, name: str) -> str:
        """``name`` with ``names``' runtime substrings replaced by their disk ones."""
        for run, disk in self.names:
            name = name.replace(run, disk)
        return name

    def runtime_name(self, name: str) -> str:
        """The inverse of disk_name."""
        for run, disk in self.names:
            name = name.replace(disk, run)
        return name
