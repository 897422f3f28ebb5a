"""One torchrun rank of a verl 0.9.1 Megatron actor run (tests/verl_megatron_fixtures.py starts it,
in verl's own venv with megatron-core 0.19.2 and mbridge 0.15.1 on its path).

verl's ``MegatronEngineWithLMHead`` builds the model the way verl does (its bridge: mbridge,
``vanilla_mbridge=True``, from the HF config in ``base/``, weights loaded by the bridge), bf16
params under Megatron's DDP and distributed optimizer, at TP or PP = 2 on 2 gloo ranks. One
training step (the causal-LM loss of megatron-core's forward, Megatron's ``finalize_model_grads``,
verl's own ``optimizer_step``) and verl's ``MegatronCheckpointManager`` saves it, as verl's trainer
does, with ``use_dist_checkpointing=True`` (or verl's default, without: the model only as the
bridge's HF export in ``model/huggingface/``): ``run/global_step_1/actor/`` (layout v2:
``model/dist_ckpt/``, ``optimizer/dist_ckpt/``, ``extra/dist_ckpt/``, ``transformer_config.json``,
``ckpt_contents.json``; ``model/huggingface/`` with config, tokenizer and the bridge's HF weights
when ``hf_model`` is among the contents). The trainer's ``data.pt`` and
``latest_checkpointed_iteration.txt`` are written beside it. ``oracle.pt``: token ids and the
logits of Megatron's own forward of the saved model (TP/PP gathered on rank 0).

Patched for a GPU-less host, here only (verl's, mbridge's and megatron-core's files untouched):
- verl's platform singleton is a CPU platform (tests/verl_child.py ``_cpu_platform``).
- ``torch.cuda`` synchronize / current_device / RNG state (bench/megatron_ckpt.py
  ``_cuda_stand_ins``), which megatron-core calls unconditionally; ``triton`` at import.
- Devices (_cuda_tensors_on_cpu): ``Module.cuda`` keeps the model where it is (mbridge's
  ``get_model`` moves it to ``torch.cuda.current_device()``); ``torch.tensor/zeros/ones/empty/full``
  with ``device='cuda'`` (megatron-core's optimizer, clipping and schedules make their scalars so)
  make them on the CPU; ``Tensor.type()`` names a CPU tensor as its CUDA type (megatron-core's
  optimizers sort parameters by ``torch.cuda.BFloat16Tensor`` / ``FloatTensor``); a current stream
  that waits for nothing (its gradient reduction waits there for CUDA-graph events).
- verl's merger: its ``get_model`` moves the model to ``f"{device}:{get_device_id()}"``, which the
  CPU platform makes ``"cpu:cpu"``: the id is 0.
- The layer spec: verl and mbridge ask megatron-core for ``get_gpt_decoder_block_spec(config,
  use_transformer_engine=True)``; Transformer Engine is CUDA-only, so the same function is called
  with ``use_transformer_engine=False`` (megatron-core's local spec, whose
  ``sharded_state_dict_keys_map`` saves its norms under TE's names: the checkpoint's keys are TE's),
  and mbridge's name map sees the local norms under those TE names too.
- mbridge 0.15.1 on megatron-core 0.19.2: ``ModelType.encoder_and_decoder`` (gone from 0.19.2)
  is a sentinel in mbridge's ``get_model``.
- ``use_dist_checkpointing`` is set on verl's checkpoint manager after the engine is built, not on
  the engine: there it also makes the engine load its first weights from a Megatron checkpoint
  made beforehand by verl's converter script (not in the wheel); the bridge loads them from the
  HF model instead. The manager saves exactly as with the engine option.
- ``sequence_parallel`` off (verl options: ``sequence_parallel`` and, since mbridge sets it for
  any TP > 1, ``override_transformer_config``): megatron-core's torch norms refuse it.

Usage: verl_mcore_child.py OUT TP PP CONTENTS MODEL (comma-separated save_contents; MODEL ``dist``:
``use_dist_checkpointing``, ``hf``: verl's default, the model saved by the bridge as HF), or
verl_mcore_child.py merge ARGS… (verl's merger, its own arguments).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "bench")]
SEQ = 12


def _local_specs() -> None:
    """Every caller of ``get_gpt_decoder_block_spec`` gets megatron-core's local spec."""
    import megatron.core.models.gpt.gpt_layer_specs as specs
    import verl.models.mcore.model_initializer as initializer
    from mbridge.core import llm_bridge

    original = specs.get_gpt_decoder_block_spec

    def local(config, use_transformer_engine, *args, **kwargs):
        return original(config, False, *args, **kwargs)

    for module in (specs, llm_bridge, initializer):
        module.get_gpt_decoder_block_spec = local


def _cuda_tensors_on_cpu() -> None:
    """megatron-core's optimizer, gradient clipping and schedules make their small bookkeeping
    tensors (loss scale, found-inf flag, norms, token counts) with ``device='cuda'``: on CPU; and
    mbridge's ``get_model`` moves the model to the GPU: it stays."""
    torch.nn.Module.cuda = lambda self, device=None: self

    def on_cpu(make):
        def made(*args, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return make(*args, **kwargs)

        return made

    for name in ("tensor", "zeros", "ones", "empty", "full"):
        setattr(torch, name, on_cpu(getattr(torch, name)))
    # ... and sorts parameters by their type string, which only names CUDA tensors.
    type_of = torch.Tensor.type

    def cuda_type(self, *args, **kwargs):
        got = type_of(self, *args, **kwargs)
        return got.replace("torch.", "torch.cuda.", 1) if not args and not kwargs and "cuda" not in got else got

    torch.Tensor.type = cuda_type
    # Megatron's gradient reduction waits on the current stream for CUDA-graph events (none here).
    from types import SimpleNamespace

    stream = SimpleNamespace(wait_event=lambda *a: None, wait_stream=lambda *a: None, synchronize=lambda: None)
    torch.cuda.current_stream = lambda *a, **k: stream


def _mbridge_local_names() -> None:
    """mbridge maps parameter names, which it knows only under TE's fused-norm names; the local
    spec's ``input_layernorm`` / ``pre_mlp_layernorm`` are renamed to them first, as megatron-core's
    own ``sharded_state_dict_keys_map`` does for the checkpoint."""
    from mbridge.core.bridge import Bridge

    original = Bridge._weight_name_mapping_mcore_to_hf

    def mapped(self, name: str) -> list[str]:
        name = name.replace(".input_layernorm.", ".self_attention.linear_qkv.layer_norm_")
        return original(self, name.replace(".pre_mlp_layernorm.", ".mlp.linear_fc1.layer_norm_"))

    Bridge._weight_name_mapping_mcore_to_hf = mapped


def _mbridge_on_mcore_019() -> None:
    """mbridge 0.15.1 compares ``ModelType.encoder_and_decoder``, which megatron-core 0.19.2 no
    longer has (only decoder models are built here): a sentinel nothing equals."""
    from types import SimpleNamespace

    from mbridge.core import util

    util.ModelType = SimpleNamespace(encoder_or_decoder=util.ModelType.encoder_or_decoder,
                                     encoder_and_decoder=object())  # fmt: skip


def setup() -> None:
    """The CPU stand-ins and patches above, before verl's worker modules are imported."""
    from megatron_ckpt import _cuda_stand_ins, _import_megatron
    from verl_child import _cpu_platform

    _cuda_stand_ins()
    _cuda_tensors_on_cpu()
    _import_megatron()
    _cpu_platform()
    from standins import without_triton

    with without_triton():
        import mbridge  # noqa: F401
    _local_specs()
    _mbridge_on_mcore_019()
    _mbridge_local_names()


def _train_step(engine, vocab: int) -> None:
    """One step: megatron-core's forward on each pipeline stage (activations sent over gloo),
    the causal-LM loss on the last, gradients reduced by Megatron, verl's optimizer step."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    module = engine.module
    tokens = torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(7))
    positions = torch.arange(SEQ).repeat(2, 1)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]

    def step(data_iterator, model):
        out = model(tokens, positions, mask, labels=tokens)

        def loss(output):
            value = output.float().mean()
            return value, {"loss": value.detach()}

        return out, loss

    config = module[0].config
    config.finalize_model_grads_func = finalize_model_grads
    engine.optimizer_zero_grad()
    get_forward_backward_func()(
        forward_step_func=step, data_iterator=iter([None]), model=module, num_microbatches=1,
        seq_length=SEQ, micro_batch_size=2, forward_only=False,
    )  # fmt: skip
    engine.optimizer_step()
    engine.lr_scheduler_step()


def _oracle(engine, vocab: int) -> dict | None:
    """Token ids and the logits of megatron-core's forward of the model as saved (rank 0)."""
    from megatron.core import mpu
    from megatron.core.pipeline_parallel import get_forward_backward_func

    module = engine.module
    tokens = torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(9))
    positions = torch.arange(SEQ).repeat(2, 1)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]
    got = {}

    def step(data_iterator, model):
        out = model(tokens, positions, mask)

        def keep(output):
            got["logits"] = output
            return output.float().sum() * 0, {}

        return out, keep

    for m in module:
        m.eval()
    with torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=step, data_iterator=iter([None]), model=module, num_microbatches=1,
            seq_length=SEQ, micro_batch_size=2, forward_only=True,
        )  # fmt: skip
    last = mpu.get_pipeline_model_parallel_last_rank()
    logits = got.get("logits")
    if mpu.get_tensor_model_parallel_world_size() > 1 and logits is not None:  # parallel_output: vocab split
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        logits = gather_from_tensor_model_parallel_region(logits)
    box = [logits.float().transpose(0, 1).contiguous() if logits is not None and logits.shape[0] == SEQ
           else logits.float() if logits is not None else None]  # fmt: skip
    if mpu.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast_object_list(box, src=last)
    return {"tokens": tokens, "logits": box[0][..., :vocab]} if dist.get_rank() == 0 else None


def main(out: Path, tp: int, pp: int, contents: list[str], dist_model: bool) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    setup()
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import HFModelConfig, McoreEngineConfig, McoreOptimizerConfig
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    model_config = HFModelConfig(path=str(out / "base"), use_remove_padding=False,
                                 enable_gradient_checkpointing=False)  # fmt: skip
    engine_config = McoreEngineConfig(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=False,
        vanilla_mbridge=True, dtype="bfloat16", seed=1,
        override_transformer_config={"sequence_parallel": False},  # mbridge turns it on for TP > 1
    )  # fmt: skip
    optim_config = McoreOptimizerConfig(lr=1e-2, total_training_steps=1, clip_grad=1.0)
    checkpoint = CheckpointConfig(save_contents=contents, load_contents=contents)
    engine = MegatronEngineWithLMHead(model_config, engine_config, optim_config, checkpoint)
    engine.initialize()
    engine.checkpoint_mananager.use_dist_checkpointing = dist_model  # see the module docstring
    vocab = model_config.hf_config.vocab_size
    _train_step(engine, vocab)
    step_dir = out / "run" / "global_step_1"
    engine.checkpoint_mananager.save_checkpoint(local_path=str(step_dir / "actor"), global_step=1)
    oracle = _oracle(engine, vocab)
    if dist.get_rank() == 0:  # as verl's ray trainer writes them beside the actor
        torch.save({"dataloader": {"epoch": 0}}, step_dir / "data.pt")
        (out / "run" / "latest_checkpointed_iteration.txt").write_text("1")
        torch.save(oracle, out / "oracle.pt")
        (out / "done.json").write_text(json.dumps({"world": dist.get_world_size(), "tp": tp, "pp": pp}))
    dist.barrier()
    dist.destroy_process_group()


def merge(args: list[str]) -> None:
    """verl's own merger (``python -m verl.model_merger merge --backend megatron …``), with the
    patches above: it builds verl's own GPTModel (``init_mcore_model``) and reads the checkpoint
    with megatron-core's ``dist_checkpointing.load``."""
    setup()
    import verl.utils.megatron_utils as megatron_utils

    megatron_utils.get_device_id = lambda: 0  # its get_model moves the model to f"{device}:{id}": "cpu:0"
    from verl.model_merger.__main__ import main as merger

    sys.argv = ["verl.model_merger", *args]
    merger()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if sys.argv[1] == "merge":
        merge(sys.argv[2:])
        sys.exit()
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(","), sys.argv[5] == "dist")
