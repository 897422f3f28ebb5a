import hashlib
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# DeepSpeed compiles its CPU ops on first use into torch's extensions folder, with this venv's paths
# in the build file: one folder per venv path, so that checkouts do not rebuild over each other's (#45).
_venv = hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions" / f"venv-{_venv}"))


def _clear_stale_build_locks(root: Path) -> None:
    """Remove the ``lock`` files that killed builds left in torch's extensions folder ``root``.

    torch's JIT build lock is a bare file with no owner: a build killed mid-way (a fixture's
    ``timeout``, a cancelled run) leaves it, and every later DeepSpeed op load waits on it forever
    (a CI run hung 90 minutes on one). A session that holds ``root``'s flock alone has no other
    session building there, so every lock it finds is stale; it then keeps a shared flock for its
    whole run, so a second session started meanwhile removes nothing."""
    import fcntl

    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / ".streamck-session", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pass
    else:
        for lock in root.glob("*/lock"):
            lock.unlink(missing_ok=True)
    fcntl.flock(fd, fcntl.LOCK_SH)  # held (fd left open) until this process exits


_clear_stale_build_locks(Path(os.environ["TORCH_EXTENSIONS_DIR"]))


# The test files whose producer fixtures take longest to build cold (verl's trainer, DeepSpeed's ops and
# runs, llm-compressor…), slowest first: run first, so that under pytest-xdist those builds overlap the
# many quick files rather than leaving one worker building while the other has nothing left (#45).
BUILD_FIRST = ("test_verl.py", "test_zero_parse.py", "test_quantize.py", "test_verl_megatron.py",
               "test_megatron_train.py", "test_moe_automodel.py", "test_titan.py", "test_lightning.py",
               "test_trainer.py", "test_moe_megatron.py", "test_dequantize.py", "test_vllm.py",
               "test_gguf.py", "test_gguf_moe.py", "test_gguf_deepseek.py", "test_gguf_gptoss.py", "test_gguf_spm.py",
               "test_gguf_rope.py",
               "test_megatron_import.py", "test_mlx.py", "test_mlx_gptoss.py")  # fmt: skip


def pytest_collection_modifyitems(items) -> None:
    """BUILD_FIRST's files first, in its order; every file's tests stay together and in order."""
    rank = {name: i for i, name in enumerate(BUILD_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_sessionfinish(session) -> None:
    """An xdist worker hands the fixtures it built to the controller, which prints the summary."""
    from fixture_cache import BUILT

    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["fixtures_built"] = json.dumps(BUILT)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    from fixture_cache import BUILT

    BUILT.extend(map(tuple, json.loads(getattr(node, "workeroutput", {}).get("fixtures_built", "[]"))))


def pytest_terminal_summary(terminalreporter) -> None:
    """The producer fixtures this run built (tests/fixture_cache.py), with their seconds: what a warm run saves."""
    from fixture_cache import BUILT

    for entry, seconds in BUILT:
        terminalreporter.write_line(f"fixture built: {entry} in {seconds:.0f} s")


@pytest.fixture(scope="session")
def dcp_ckpts(tmp_path_factory):
    """Real DCP checkpoints in three layouts, written once per session by torch (tests/dcp_fixtures.py)."""
    from dcp_fixtures import make_dcp_checkpoints

    return make_dcp_checkpoints(tmp_path_factory.mktemp("dcp"))


@pytest.fixture(scope="session")
def zero_cases(request, tmp_path_factory) -> dict[str, dict]:
    """Real DeepSpeed ZeRO-1/2/3 checkpoints with zero_to_fp32's output beside each, made
    once (tests/zero_fixtures.py) and kept on the machine (tests/fixture_cache.py)."""
    import zero_fixtures
    from fixture_cache import fixture_root

    root = fixture_root(tmp_path_factory, "zero", "tests/zero_fixtures.py")
    return {c["name"]: c for c in zero_fixtures.make_zero_checkpoints(root)}


@pytest.fixture(scope="session")
def trainer_cases(request, tmp_path_factory) -> dict[str, dict]:
    """Checkpoints written by HF Trainer + DeepSpeed under torchrun (tests/trainer_fixtures.py),
    made once and kept on the machine (tests/fixture_cache.py)."""
    import trainer_fixtures
    from fixture_cache import fixture_root

    root = fixture_root(tmp_path_factory, "trainer", "tests/trainer_fixtures.py")
    return trainer_fixtures.make_trainer_checkpoints(root)


@pytest.fixture(scope="session")
def dcp_trainers(tmp_path_factory) -> dict[str, Path]:
    """DCP checkpoints as trainers write them (FSDP2, TP, HSDP, DDP, per-rank metadata…),
    written once per session by torch on 4 gloo ranks (tests/dcp_trainers.py)."""
    from dcp_trainers import make_trainer_checkpoints

    return make_trainer_checkpoints(tmp_path_factory.mktemp("dcp_trainers"))


@pytest.fixture(scope="session")
def moe_saves(tmp_path_factory):
    """Each MoE family's tiny model, save_pretrained folder and runtime save, made once for every
    test that only reads them (tests/test_moe_families.py, test_moe_fp32.py)."""
    from moe_models import Saves

    return Saves(tmp_path_factory.mktemp("moe-saves"))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A SeaweedFS S3 server on loopback for the test module (tests/s3_server.py)."""
    from s3_server import foreign_sockets, start

    srv = start(tmp_path_factory.mktemp("s3"))
    yield srv
    try:  # after every test of the module: the server, the proxy and s3fs here were on loopback only
        assert foreign_sockets(srv.proc.pid) == foreign_sockets(os.getpid()) == []
    finally:
        srv.stop()


@pytest.fixture
def bucket(server):
    """A new empty bucket on ``server``."""
    return server.bucket()
