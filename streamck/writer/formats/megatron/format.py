"""Megatron-LM's ``torch_dist`` checkpoint from a Hugging Face GPT, as a run root that
``pretrain_gpt.py --load RUN --finetune`` loads at any TP/PP/EP:

    RUN/latest_checkpointed_iteration.txt     "0" (Megatron-Bridge's import saves iteration 0)
    RUN/iter_0000000/metadata.json            {"sharded_backend": "torch_dist", ...}
    RUN/iter_0000000/.metadata                torch's DCP Metadata (dcp.py)
    RUN/iter_0000000/__0_0.distcp …           the chunks (table.py) and the non-sharded state
    RUN/config.json, tokenizer files          the Hugging Face model's, as they were

Beside the model's tensors under megatron-core 0.19.2's sharded keys, the non-sharded state is
what megatron-core's ``dist_checkpointing.load_common_state_dict`` reads and Megatron-LM's
``load_checkpoint`` needs, the ``common_state`` item: ``args`` (an ``argparse.Namespace`` of the
model's flags, TP=PP=1, ``no_save_optim`` and ``no_save_rng``, so that no optimizer or RNG state
is asked for), ``checkpoint_version`` 3.0, ``iteration`` 0 and ``content_metadata``; and every
linear's ``_extra_state`` per layer (``[None]``, what a model without FP8 state saves).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from streamck.dtypes import nbytes
from streamck.errors import OutputError, PlanError, UsageError
from streamck.fileio import write_all
from streamck.plan import Plan
from streamck.plan.megatron.layout import HEAD
from streamck.units import human
from streamck.writer.formats.base import Format, TensorBytes
from streamck.writer.formats.megatron import common
from streamck.writer.formats.megatron.dcp import Item, Piece, metadata
from streamck.writer.formats.megatron.pickles import archive, object_bytes, tensor_pickle
from streamck.writer.formats.megatron.shard import DcpShard, split
from streamck.writer.formats.megatron.table import model, padded_vocab, pieces

if TYPE_CHECKING:
    from streamck.writer.options import WriteOptions

ITERATION = 0
DIVISIBLE = 128  # Megatron-LM's --make-vocab-size-divisible-by default
STEP = f"iter_{ITERATION:07d}"
TRACKER = "latest_checkpointed_iteration.txt"
BACKEND = b'{"sharded_backend": "torch_dist", "sharded_backend_version": 1}'
_ZEROS = bytes(4 << 20)


class Megatron(Format):
    """``--format megatron``: the run root above from a Hugging Face GPT's stored (or cast) tensors.

    ``prepare`` places every tensor as chunks of megatron-core's keys (table.py, moe.py) and builds
    the non-sharded state (common.py); ``layout`` frames each chunk as a ``torch.save`` archive and
    splits them over ``.distcp`` files; ``write`` moves each chunk's bytes (zeros for the padded
    vocabulary); ``extras`` adds the tracker, ``metadata.json`` and ``.metadata``.
    """

    name = "megatron"
    title = "a Megatron torch_dist checkpoint"
    single_name = STEP
    verifies = False

    def __init__(self) -> None:
        self.pieces: list[Piece] = []
        self.objects: list[tuple[str, bytes]] = []

    def prepare(self, plan: Plan, options: WriteOptions) -> Plan:
        config, where = _config(plan)
        computed = [t.name for t in plan.tensors if t.transform is not None]
        if computed:
            raise PlanError(
                f"{{format}} megatron writes stored or cast tensors, not computed ones ({computed[0]})", where
            )
        divisible = options.make_vocab_size_divisible_by or DIVISIBLE
        m = model(config, where)
        padded = _padded(m.sizes["V"], divisible, where, given=options.make_vocab_size_divisible_by is not None)
        named = {t.name: t for t in plan.tensors}
        dropped = [named.pop(HEAD[0]).name] if m.tied and HEAD[0] in named else []  # transformers ties it on load
        self.pieces = pieces(named, m, padded, where)
        dtype = plan.tensors[0].dtype if plan.tensors else "F32"
        args = common.args(config, m, padded, divisible, dtype, where)
        state = (common.COMMON, object_bytes(common.state(args, ITERATION)))
        self.objects = [*common.extra_states(m.sizes["L"], m.sizes.get("E", 0), "S" in m.sizes), state]
        s = m.sizes
        experts = f", {s['E']} experts of {s['Im']} (top {s['k']})" if m.moe else ""
        summary = [f"Megatron GPTModel ({config['model_type']}): L={s['L']} H={s['H']} heads={s['nh']} "
                   f"groups={s['nkv']} d={s['d']} I={s['I']} vocab {s['V']} padded to {padded} "
                   f"(a multiple of {divisible}){', tied head' if m.tied else ''}"
                   f"{experts}"]  # fmt: skip
        if dropped:
            summary.append(
                f"{dropped[0]} left out: the config ties the head to the embedding, as transformers loads it"
            )
        zeros = sum(_nbytes(p.chunk.dtype, p.chunk.sizes) for p in self.pieces if p.tensor is None)
        if zeros:  # written beside the tensors, so in no tensor's size: the total below leaves them out
            summary.append(f"the padded vocabulary's zero rows add {human(zeros)} ({zeros} bytes) to the total")
        tensors = [p.tensor for p in self.pieces if p.tensor is not None]
        return Plan(tensors, {}, plan.files, source=plan.source, summary=[*plan.summary, *summary],
                    side_files=plan.side_files, notices=plan.notices)  # fmt: skip

    def check(self, plan: Plan, options: WriteOptions, target: Path | str) -> None:
        super().check(plan, options, target)
        if options.keep_shards:
            raise UsageError("{keep_shards} writes safetensors files; drop it for {format} megatron")
        if options.part is not None:
            raise UsageError("{part} splits safetensors or torch outputs; {format} megatron is written whole")
        if str(target).endswith((".safetensors", ".bin", ".pt", ".pth", ".gguf")):
            raise OutputError("{format} megatron writes a run folder; give a directory", target)

    def layout(self, plan: Plan, filename: str, options: WriteOptions) -> list[DcpShard]:
        items: list[tuple[Item, object]] = []
        for p in self.pieces:
            c = p.chunk
            nbytes = p.tensor.nbytes if p.tensor is not None else _nbytes(c.dtype, c.sizes)
            before, after = archive(tensor_pickle(c.dtype, c.sizes), nbytes)
            items.append((Item(c.key, before, after, nbytes, chunk=c), p.tensor))
        items += [(Item(fqn, data, b""), None) for fqn, data in self.objects]
        return split(items, f"{STEP}/__{{n}}_0.distcp", options.max_shard_size, self.name)

    def write(self, shard: DcpShard, tensors: TensorBytes, out: int) -> None:
        for item in shard.items:
            write_all(out, item.before)
            if item.tensor is not None:
                tensors.copy([shard.tensors[item.tensor]], out)
            elif item.data:
                tensors.put(out, _zeros(item.data))
            write_all(out, item.after)

    def extras(self, plan: Plan, shards: list[DcpShard]) -> dict[str, Path | bytes]:
        files = [(s.filename.rsplit("/", 1)[-1], s.items) for s in shards]
        ours = {
            TRACKER: str(ITERATION).encode(),
            f"{STEP}/metadata.json": BACKEND,
            f"{STEP}/.metadata": metadata(files),
        }
        return {**plan.side_files, **plan.files, **ours}  # the plan's own files win over copies


def _padded(vocab: int, divisible: int, where: Path | None, given: bool) -> int:
    """The padded vocabulary; a PlanError where a ``given`` divisor's padding would add more rows
    than the vocabulary has (one meant for another model: a file of mostly zeros). Megatron-LM's
    default, 128, pads a toy vocabulary as Megatron itself would."""
    padded = padded_vocab(vocab, divisible)
    if given and padded - vocab > vocab:
        what = f"{padded - vocab} zero rows, more than it has: give a divisor of at most {vocab}"
        raise PlanError(
            f"{{make_vocab_size_divisible_by}} {divisible} pads the {vocab}-row vocabulary with {what}", where
        )
    return padded


def _nbytes(dtype: str, sizes: tuple[int, ...]) -> int:
    n = 1
    for d in sizes:
        n *= d
    return nbytes(dtype, n)


def _zeros(n: int):
    while n:
        piece = min(n, len(_ZEROS))
        yield memoryview(_ZEROS)[:piece]
        n -= piece


def _config(plan: Plan) -> tuple[dict, Path | None]:
    """The Hugging Face config the plan carries (its own, or the one beside the weights)."""
    found = plan.files.get("config.json", plan.side_files.get("config.json"))
    if found is None:
        raise PlanError("{format} megatron needs the model's config.json beside the weights (its sizes and family)")
    where = found if isinstance(found, Path) else None
    try:
        config = json.loads(found.read_bytes() if isinstance(found, Path) else found)
    except (OSError, ValueError) as e:
        raise PlanError(f"config.json cannot be read: {e}", where) from None
    if not isinstance(config, dict):
        raise PlanError("config.json is not a JSON object", where)
    return config, where
