"""One torchrun rank of a verl 0.9.1 actor run (tests/verl_fixtures.py starts it, in verl's own venv).

verl's FSDP engine (``FSDPEngineWithLMHead``, built from verl's config dataclasses) loads a tiny
HF model from ``base/``, shards it with FSDP1 or FSDP2 (verl's ``strategy``), takes one training
step (the HF causal-LM loss, verl's own ``optimizer_step``) and saves through verl's
``FSDPCheckpointManager`` into ``run/global_step_1/actor/``, as verl's trainer does; the trainer's
``data.pt`` and ``latest_checkpointed_iteration.txt`` are written beside it as the trainer writes
them. ``live.pt``: the trained model's full state dict (torch's ``get_model_state_dict``).

Patched for a GPU-less host, here only (verl's files are untouched):
- verl's platform singleton is set to a CPU platform (device "cpu", backend gloo, no-op memory
  calls) before verl's worker modules are imported: verl picks "nvidia" when it finds no
  accelerator, and every device call would then go to torch.cuda.
- FSDP1 only: verl passes ``sync_module_states=True``, which torch refuses for CPU modules
  (``_check_module_states_for_sync_module_states`` wants an accelerator); that check is relaxed.
  The broadcast itself still runs (over gloo).
- The checkpoint manager is called directly: the engine's ``save_checkpoint`` wrapper moves the
  model to ``f"{device}:{id}"`` ("cpu:cpu" here), which torch refuses.

Usage: verl_child.py OUT STRATEGY(fsdp|fsdp2) FSDP_SIZE LORA_RANK (a rank), or
verl_child.py base OUT ARCH(qwen2|llama) [HIDDEN INTER LAYERS VOCAB] (the model the run starts
from, in ``OUT/base``; bench/verl_ckpt.py gives larger dimensions).
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist


def _cpu_platform() -> None:
    from verl.plugin.platform import set_platform
    from verl.plugin.platform.platform_cuda import PlatformCUDA

    class PlatformCPU(PlatformCUDA):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = torch.cpu

        def is_available(self) -> bool:
            return True

        def current_device(self):
            return torch.device("cpu")  # FSDP1's device_id: an int would mean cuda:N

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index) -> None:
            pass

        def synchronize(self, device_index=None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def communication_backend_name(self) -> str:
            return "gloo"

        @contextmanager
        def nvtx_range(self, msg: str):
            yield

    set_platform(PlatformCPU())
    # verl calls these on the device module (torch.cpu here) for its memory logs and offloads.
    for name in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved", "empty_cache"):
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, lambda *a, **k: 0)
    if not hasattr(torch.cpu, "mem_get_info"):
        torch.cpu.mem_get_info = lambda *a, **k: (1 << 34, 1 << 35)


def _fsdp1_on_cpu() -> None:
    """FSDP1's sync_module_states check refuses CPU modules; the broadcast itself runs on gloo."""
    import torch.distributed.fsdp._init_utils as init_utils

    init_utils._check_module_states_for_sync_module_states = lambda *a, **k: None


VOCAB, HIDDEN = 320, 64  # 320 rows: torch.chunk on 3 ranks gives 107/107/106


def make_base(out: Path, arch: str, dims: list[int] = ()) -> None:
    """A tiny HF model (Qwen2 with a tied head, or Llama untied) and a word-level tokenizer;
    ``dims`` (hidden, intermediate, layers, vocab) makes it larger."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config

    hidden, inter, layers, vocab = dims or (HIDDEN, 96, 2, VOCAB)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    if arch == "qwen2":
        config = Qwen2Config(**common, tie_word_embeddings=True)
    else:
        config = LlamaConfig(**common, tie_word_embeddings=False)
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out / "base")
    words = {"<pad>": 0, "<eos>": 1, "<unk>": 2} | {f"w{i}": i for i in range(3, vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.save_pretrained(out / "base")


def main(out: Path, strategy: str, fsdp_size: int, lora_rank: int) -> None:
    dist.init_process_group("gloo")
    _cpu_platform()
    if strategy == "fsdp":
        _fsdp1_on_cpu()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    rank = dist.get_rank()
    model_config = HFModelConfig(
        path=str(out / "base"),
        use_remove_padding=False,
        enable_gradient_checkpointing=False,
        lora_rank=lora_rank,
        lora_alpha=2 * lora_rank if lora_rank else 16,
        target_modules=["q_proj", "v_proj"],
        override_config={"attn_implementation": "sdpa"},
    )
    engine_config = FSDPEngineConfig(
        strategy=strategy, fsdp_size=fsdp_size, use_torch_compile=False, model_dtype="fp32", seed=1
    )
    optim_config = FSDPOptimizerConfig(lr=1e-2, total_training_steps=1, clip_grad=1.0)
    engine = FSDPEngineWithLMHead(model_config, engine_config, optim_config, CheckpointConfig())
    engine.initialize()
    module = engine.module
    gen = torch.Generator().manual_seed(11 + rank)
    ids = torch.randint(0, model_config.hf_config.vocab_size, (2, 16), generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=strategy == "fsdp"):
        loss = module(input_ids=ids, labels=ids).loss
    loss.backward()
    engine.optimizer_step()
    engine.lr_scheduler_step()
    step_dir = out / "run" / "global_step_1"
    engine.checkpoint_manager.save_checkpoint(local_path=str(step_dir / "actor"), global_step=1)
    live = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    if rank == 0:  # as verl's ray trainer writes them beside the actor
        torch.save({"dataloader": {"epoch": 0}}, step_dir / "data.pt")
        (out / "run" / "latest_checkpointed_iteration.txt").write_text("1")
        torch.save({k: v.detach().float().clone() for k, v in live.items()}, out / "live.pt")
        (out / "done.json").write_text(json.dumps({"world": dist.get_world_size()}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if sys.argv[1] == "base":
        make_base(Path(sys.argv[2]), sys.argv[3], [int(d) for d in sys.argv[4:8]])
    else:
        main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
