"""NeMo Automodel 0.7.0 MoE steps, written by its model code and ``Checkpointer`` under torchrun
on CPU/gloo, as its recipe ``train_ft`` saves them, for the two kinds of MoE it trains.

``make_automodel_moe_runs(root)`` launches ``torchrun --nproc_per_node 2``. Every rank builds, in turn:

* ``qwen3_moe``, ``deepseek_v3`` (MLA, a dense first layer, a shared expert, the routing bias
  ``e_score_correction_bias`` that training moves) and ``gpt_oss`` (biases, attention sinks):
  Automodel's own ``Qwen3MoeForCausalLM``, ``DeepseekV3ForCausalLM`` and ``GptOssForCausalLM``
  (components/models/: grouped experts ``experts.gate_and_up_projs`` [E, H, 2I] and
  ``experts.down_projs`` [E, I, H]; torch backends, its defaults without a GPU), sharded by the MoE
  ``parallelize_model`` (what ``_shard_ep_fsdp`` calls) over ``MeshContext.build(FSDP2Config(),
  ParallelismSizes(ep_size=2))``: expert parallelism 2 (each rank holds 2 of the 4 experts) and
  FSDP over both ranks. Their state-dict adapters save what the Hugging Face families hold on disk:
  Qwen3-MoE's and DeepSeek-V3's (``MoESplitExpertsStateDictMixin``) every expert under
  save_pretrained's per-expert names, gpt-oss's the fused ``mlp.experts.gate_up_proj`` & co.
* ``mixtral``: transformers' ``MixtralForCausalLM`` (Automodel 0.7.0 has no Mixtral of its own, so
  it trains the Hugging Face model), sharded by Automodel's FSDP2 ``model_parallelizer
  .parallelize_model`` over both ranks. There is no adapter: it saves transformers' fused runtime
  experts ``mlp.experts.gate_up_proj`` / ``down_proj``, and so does Automodel's consolidation.

Each records its pre-shard Hugging Face keys as ``apply_model_infrastructure`` does, trains two
AdamW steps and after each saves a step as ``BaseRecipe.save_checkpoint`` does
(``lifecycle.reserve``, ``save_losses``, ``model.save_pretrained(checkpointer=…)`` or
``checkpointer.save_model``, ``save_optimizer``, ``save_config``, ``lifecycle.publish``, which sets
``LATEST``), into three run roots, one per checkpoint config a user picks:

* ``sharded/``: ``model_save_format: safetensors``, ``save_consolidated: false`` (what Automodel
  recommends for large models): torch's sharded safetensors in ``model/``, one file per rank,
  config.json and ``fqn_to_file_index_mapping.json`` in ``model/.hf_metadata/``;
* ``consolidated/``: ``save_consolidated: final``: the last step also holds ``model/consolidated/``,
  Automodel's own consolidation of those shards;
* ``torch_save/``: native DCP in ``model/`` and no config.json anywhere.

Oracles, per family: ``hf/``, transformers' ``save_pretrained`` of the trained weights (for
Automodel's own models, ``from_pretrained`` of their adapter's own ``to_hf`` of them); ``logits.pt``,
the trainer's model's forward of the trained weights on ``moe_models.logits``'s tokens, in fp32 on
one rank (training computes in bf16: Automodel's FSDP2 mixed-precision default).

Patched in this driver only, none of it checkpoint code: Automodel's Qwen3-MoE and gpt-oss build
their rotary embedding for ``cuda:{torch.cuda.current_device()}``, which a CPU torch refuses:
``current_device`` answers 0 while a model is built, and ``initialize_weights(buffer_device=cpu)``
moves it to the CPU (as the recipe does for its device); gpt-oss's FlexAttention runs eager
(``_eager_flex_on_cpu``). Its torch experts and dispatcher, sdpa and the gloo collectives run as
shipped. Built once into ``root/automodel-moe-<versions>-v<FIXTURE_VERSION>``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import built_once
from moe_models import VOCAB, tiny_config, tiny_model
from trainer_fixtures import _free_port

FIXTURE_VERSION = 4
FAMILIES = ("qwen3_moe", "deepseek_v3", "gpt_oss", "mixtral")
# The families Automodel has models of its own for: model_type -> (components/models/<module>, class).
AUTOMODEL = {
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3ForCausalLM"),
    "gpt_oss": ("gpt_oss", "GptOssForCausalLM"),
}


def _eager_flex_on_cpu() -> None:
    """Automodel's GPT-OSS runs FlexAttention only (or TE), through a ``torch.compile``d
    ``flex_attention``: torch's inductor refuses it on the CPU (``return_lse``), and eager
    ``flex_attention`` refuses its backward on the CPU by a device check. Eager, check skipped."""
    import torch.nn.attention.flex_attention as flex
    from nemo_automodel.components.attention.flex_attention import FlexAttention

    FlexAttention.flex_attn = flex.flex_attention
    flex._validate_device = lambda *tensors: None


STEPS = 2
# run root -> (model_save_format, save_consolidated)
RUNS = {
    "sharded": ("safetensors", "false"),
    "consolidated": ("safetensors", "final"),
    "torch_save": ("torch_save", "false"),
}


def _automodel(family: str):
    """Automodel's own model of ``family`` (AUTOMODEL), fp32, built on the CPU (see the module's
    doc for the one patch)."""
    import importlib

    import torch
    from nemo_automodel.components.models.common import BackendConfig

    module, name = AUTOMODEL[family]
    cls = getattr(importlib.import_module(f"nemo_automodel.components.models.{module}.model"), name)
    config = tiny_config(family, dtype="float32", architectures=[name])
    backend = BackendConfig()  # without a GPU: sdpa, torch linear and norms, torch experts and dispatcher
    if family == "gpt_oss":  # it asserts flex or TE attention
        _eager_flex_on_cpu()
        backend = BackendConfig(attn="flex")
    current = torch.cuda.current_device
    torch.cuda.current_device = lambda: 0
    try:
        torch.manual_seed(11)
        model = cls(config, backend=backend)
    finally:
        torch.cuda.current_device = current
    model.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
    return model


def _plain(family: str):
    """The family's model as its trainer builds it, unsharded, fp32."""
    return _automodel(family) if family in AUTOMODEL else tiny_model(family, seed=11).train()


def _sharded(family: str):
    """(model, mesh): the family's model sharded as Automodel shards it, its pre-shard Hugging
    Face keys recorded as apply_model_infrastructure records them."""
    from nemo_automodel.components.checkpoint.checkpointing import _maybe_adapt_state_dict_to_hf
    from nemo_automodel.components.distributed import model_parallelizer
    from nemo_automodel.components.distributed.config import FSDP2Config
    from nemo_automodel.components.distributed.mesh import MeshContext, ParallelismSizes
    from nemo_automodel.components.moe import parallelizer as moe_parallelizer

    model = _plain(family)
    if family in AUTOMODEL:
        keys = model.state_dict_adapter.get_hf_state_dict_keys(model.state_dict())
        mesh = MeshContext.build(FSDP2Config(), ParallelismSizes(ep_size=2))
        axes = mesh.parallelize_axis_kwargs()
        moe_parallelizer.parallelize_model(model, world_mesh=mesh.device_mesh, moe_mesh=mesh.moe_mesh, **axes)
    else:
        keys = [k for k in _maybe_adapt_state_dict_to_hf(model, model.state_dict()) if not k.endswith("_extra_state")]
        mesh = MeshContext.build(FSDP2Config(), ParallelismSizes())
        model = model_parallelizer.parallelize_model(model, mesh)
    model._pre_shard_hf_state_dict_keys = keys
    return model, mesh


def _save_step(model, opt, mesh, root: Path, run: str, step: int, loss: float) -> None:
    """One step saved as BaseRecipe.save_checkpoint saves it, with ``run``'s checkpoint config
    (its ``model.save_pretrained(checkpointer=…)`` is this ``save_model``)."""
    import torch.distributed as dist
    from nemo_automodel.components.checkpoint.checkpointing import save_config, save_losses
    from nemo_automodel.components.checkpoint.config import CheckpointingConfig

    fmt, consolidated = RUNS[run]
    config = CheckpointingConfig(checkpoint_dir=str(root / run), model_save_format=fmt, save_consolidated=consolidated)
    checkpointer = config.build(dp_rank=dist.get_rank(), tp_rank=0, pp_rank=0, moe_mesh=mesh.moe_mesh)
    path = str(root / run / f"epoch_0_step_{step}")
    checkpointer.lifecycle.reserve(path)
    if dist.get_rank() == 0:
        save_losses({"train_loss": loss}, path)
    dist.barrier()
    checkpointer.save_model(model=model, weights_path=path, is_final_checkpoint=step == STEPS)
    checkpointer.save_optimizer(opt, model, path, None)
    recipe = {"recipe": "TrainFinetuneRecipeForNextTokenPrediction"}
    save_config({**recipe, "checkpoint": {"model_save_format": fmt, "save_consolidated": consolidated}}, path)
    checkpointer.lifecycle.publish(path, best_val_metric=None, metric_key=None)
    checkpointer.close()


def _oracles(family: str, model, root: Path) -> None:
    """``hf/`` and ``logits.pt`` (see the module's doc)."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if dist.get_rank() == 0:
        plain = _plain(family).eval()  # unsharded, fp32: the trained weights without FSDP's bf16 compute
        plain.load_state_dict(full)
        ids = (torch.arange(24).reshape(2, 12) * 7 + 3) % VOCAB  # the tokens moe_models.logits runs
        with torch.no_grad():
            torch.save(plain(ids).logits, root / "logits.pt")
        if family not in AUTOMODEL:
            plain.save_pretrained(root / "hf")
        else:
            hf = model.state_dict_adapter.to_hf({k: v.detach().clone() for k, v in full.items()})
            src = root / "to_hf"
            src.mkdir()
            save_file({k: v.contiguous() for k, v in hf.items()}, src / "model.safetensors", metadata={"format": "pt"})
            config = root / "sharded" / f"epoch_0_step_{STEPS}" / "model" / ".hf_metadata" / "config.json"
            (src / "config.json").write_bytes(config.read_bytes())
            AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).save_pretrained(root / "hf")
    dist.barrier()


def _train(family: str, root: Path) -> None:
    """Two AdamW steps of ``family``, each saved into every run root, then its oracles."""
    import torch
    import torch.distributed as dist

    model, mesh = _sharded(family)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(5 + dist.get_rank())
    for step in range(1, STEPS + 1):
        ids = torch.randint(0, VOCAB, (2, 12), generator=gen)
        out = model(ids).logits
        loss = torch.nn.functional.cross_entropy(out[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if hasattr(model, "update_moe_gate_bias"):  # as train_ft does after each step
            model.update_moe_gate_bias()
        for run in RUNS:
            _save_step(model, opt, mesh, root, run, step, loss.item())
    _oracles(family, model, root)


def _worker(root: Path) -> None:
    import torch.distributed as dist
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    dist.init_process_group("gloo")
    for family in FAMILIES:
        _train(family, root / family)
    dist.destroy_process_group()


def _versions() -> str:
    from importlib.metadata import version

    import torch
    import transformers

    # Not nemo_automodel.__version__: it appends the git HEAD of whatever repository holds the venv.
    versions = (version("nemo-automodel"), transformers.__version__, torch.__version__)
    return "nemo_automodel-{}-transformers-{}-torch-{}".format(*versions)


def make_automodel_moe_runs(root: Path) -> Path:
    """Build (once) the runs under ``root`` and return their folder, with one folder per family:
    ``sharded/``, ``consolidated/``, ``torch_save/`` (each ``epoch_0_step_1``, ``epoch_0_step_2``,
    ``LATEST``), ``hf/`` and ``logits.pt``."""
    base = Path(root) / f"automodel-moe-{_versions()}-v{FIXTURE_VERSION}"

    def build(tmp: Path) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        # timeout's SIGTERM lets torchrun stop its ranks; a kill from subprocess would orphan them
        cmd = ["timeout", "-k", "20", "840", sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               f"--master_port={_free_port()}", __file__, str(tmp), "rank"]  # fmt: skip
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode:
            raise RuntimeError(f"Automodel MoE run failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
        (tmp / "families.json").write_text(json.dumps(FAMILIES))

    return built_once(base, build)


if __name__ == "__main__":
    if len(sys.argv) == 3:  # a torchrun rank
        _worker(Path(sys.argv[1]))
    else:
        print(make_automodel_moe_runs(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/automodel-moe-fixtures")))
