"""--device cuda: the overlapped schedule (against a fake device, no GPU needed) and,
on a machine with a GPU, the bits of every cast against torch's CPU Tensor.to()."""

import contextlib
import json

import numpy as np
import pytest
import torch
from helpers import cli, raw_file
from test_cast import ALL_16, _f32_ties, assert_same_as_torch, cast_via_streamck

from streamck import Rules, compile_plan, open_checkpoint, write_plan
from streamck.transforms.cudacast import pipeline

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class EagerDevice:
    """Does a slot's work at submit time: the earliest a real device could. A host that
    fills a slot's input after submitting it, or reads its output before, is caught."""

    def __init__(self, slots: int, size: int):
        self.inp = [bytearray(size) for _ in range(slots)]
        self.out = [bytearray(size) for _ in range(slots)]
        self.in_flight = self.most_in_flight = 0

    def submit(self, slot: int, k: int):
        self.out[slot][:k] = bytes(b ^ 0x5A for b in self.inp[slot][:k])
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        device = self

        class Event:
            done = False

            def synchronize(self) -> None:
                if not self.done:
                    device.in_flight -= 1
                    self.done = True

        return Event()


def pipeline_without_the_wait(steps, slots, read, submit, write):
    """The negative control: ``pipeline`` with the event wait left out."""
    pending = []
    for i, (start, count) in enumerate(steps):
        if len(pending) == slots:
            slot, k, _ = pending.pop(0)
            write(slot, k)
        slot = i % slots
        read(slot, start, count)
        pending.append((slot, count, submit(slot, count)))
    for slot, k, _ in pending:
        write(slot, k)


def _run_pipeline(run, device_cls, slots: int, n: int):
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    chunk = 3
    steps = [(i, min(chunk, n - i)) for i in range(0, n, chunk)]
    dev, written = device_cls(slots, chunk), bytearray()

    def read(slot: int, start: int, k: int) -> None:
        dev.inp[slot][:k] = data[start : start + k]

    run(steps, slots, read, dev.submit, lambda slot, k: written.extend(dev.out[slot][:k]))
    return dev, bytes(written) == bytes(b ^ 0x5A for b in data), len(steps)


class LateDevice:
    """Does a slot's work only when its event is synchronized: the latest a real device
    could. A host that refills a slot's input, or writes its output, before that point
    reads or writes another chunk's bytes, and the output comes out wrong."""

    def __init__(self, slots: int, size: int):
        self.inp = [bytearray(size) for _ in range(slots)]
        self.out = [bytearray(size) for _ in range(slots)]
        self.in_flight = self.most_in_flight = 0

    def submit(self, slot: int, k: int):
        device = self
        device.in_flight += 1
        device.most_in_flight = max(device.most_in_flight, device.in_flight)

        class Event:
            done = False

            def synchronize(self) -> None:
                if not self.done:
                    device.out[slot][:k] = bytes(b ^ 0x5A for b in device.inp[slot][:k])
                    device.in_flight -= 1
                    self.done = True

        return Event()


@pytest.mark.parametrize("device_cls", [LateDevice, EagerDevice])
@pytest.mark.parametrize("slots", [2, 3])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 1000])
def test_pipeline_touches_a_slot_only_after_its_work(device_cls, slots, n):
    dev, right, steps = _run_pipeline(pipeline, device_cls, slots, n)
    assert right
    assert dev.in_flight == 0
    assert dev.most_in_flight == min(slots, steps)  # overlapped, never more than the slots


def test_the_late_device_catches_a_pipeline_that_does_not_wait():
    _, right, _ = _run_pipeline(pipeline_without_the_wait, LateDevice, 2, 1000)
    assert not right


class StandIn:
    """torch.cuda replaced by a synchronous stand-in on the CPU (pinned and device buffers
    become plain ones), recording what the caster asks of it: which device was current
    when, and which streams were waited for."""

    def __init__(self, monkeypatch, count: int = 1, fail_pinned: BaseException | None = None):
        self.current, self.synced, self.pinned_on = 0, [], []
        real_empty, real_zeros = torch.empty, torch.zeros
        stand_in = self

        def on_cpu(kw):
            if kw.pop("pin_memory", False):
                if fail_pinned is not None:
                    raise fail_pinned
                stand_in.pinned_on.append(stand_in.current)
            return {**kw, "device": "cpu"}

        class Stream:
            def __init__(self, *args):
                pass

            def wait_stream(self, other):
                pass

            def synchronize(self):
                stand_in.synced.append(self)

        class Event:
            def record(self, stream):
                pass

            def synchronize(self):
                pass

        @contextlib.contextmanager
        def device(d):
            saved, stand_in.current = stand_in.current, torch.device(d).index
            try:
                yield
            finally:
                stand_in.current = saved

        monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **on_cpu(k)))
        monkeypatch.setattr(torch, "zeros", lambda *a, **k: real_zeros(*a, **on_cpu(k)))
        for name, value in {
            "is_available": lambda: True,
            "device_count": lambda: count,
            "current_device": lambda: stand_in.current,
            "device": device,
            "Stream": Stream,
            "Event": Event,
            "current_stream": lambda device=None: Stream(),
            "stream": lambda stream: contextlib.nullcontext(),
            "synchronize": lambda device=None: None,
        }.items():
            monkeypatch.setattr(torch.cuda, name, value)


no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="stands in for torch.cuda where there is no GPU")


@no_gpu
def test_cuda_caster_host_code_with_a_stand_in_for_torch_cuda(tmp_path, monkeypatch):
    # The plumbing (slots, slices, overflow counters, the pipeline), not the device.
    cuda = StandIn(monkeypatch, count=2)
    plan = compile_plan(open_checkpoint(_checkpoint(tmp_path)), Rules(dtype="F16"))
    gpu = write_plan(plan, tmp_path / "out" / "g.safetensors", chunk=40_000, device="cuda:1")
    cpu = write_plan(plan, tmp_path / "out" / "c.safetensors", chunk=40_000, device="cpu")
    assert gpu.overflow == cpu.overflow != {}
    assert (tmp_path / "out" / "g.safetensors").read_bytes() == (tmp_path / "out" / "c.safetensors").read_bytes()
    assert cuda.pinned_on and set(cuda.pinned_on) == {1}  # made with cuda:1 current: no context on GPU 0
    assert cuda.current == 0  # and the process's current device left as it was


@no_gpu
def test_a_device_ordinal_beyond_the_machine_is_one_line(tmp_path, monkeypatch, capsys):
    from streamck.cli import main

    StandIn(monkeypatch, count=1)
    args = ["rewrite", str(_checkpoint(tmp_path)), "-o", str(tmp_path / "o" / "o.safetensors"), "--dtype", "bf16"]
    assert main([*args, "--device", "cuda:1"]) == 2
    err = capsys.readouterr().err
    assert "cuda:1: this machine has 1 CUDA device(s), cuda:0 to cuda:0" in err and err.count("\n") == 1
    assert not (tmp_path / "o" / "o.safetensors").exists()


@no_gpu
def test_out_of_memory_is_one_line(tmp_path, monkeypatch, capsys):
    from streamck.cli import main

    StandIn(monkeypatch, fail_pinned=torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 16 MiB\nmore"))
    args = ["rewrite", str(_checkpoint(tmp_path)), "-o", str(tmp_path / "o" / "o.safetensors"), "--dtype", "bf16"]
    assert main([*args, "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err == "streamck: error: --device cuda: CUDA out of memory. Tried to allocate 16 MiB\n"


@no_gpu
def test_an_error_mid_tensor_waits_for_the_slot_streams(tmp_path, monkeypatch):
    from streamck import CheckpointError, Rule
    from streamck.transforms.cudacast import CudaCaster

    cuda = StandIn(monkeypatch)
    path = _checkpoint(tmp_path)
    plan = compile_plan(open_checkpoint(path), Rules((Rule("keep", "big"),), dtype="F16"))
    with open(path, "r+b") as f:  # the source is cut short after indexing: the read fails mid-tensor
        f.truncate(600_000)
    caster = CudaCaster(40_000, "cuda")
    monkeypatch.setattr("streamck.transforms.casters.CudaCaster", lambda *a, **k: caster)
    with pytest.raises(CheckpointError, match="ended before"):
        write_plan(plan, tmp_path / "o" / "g.safetensors", chunk=40_000, device="cuda")
    assert {id(s) for *_, s in caster.slots} <= {id(s) for s in cuda.synced}


def _checkpoint(tmp_path):
    rng = np.random.default_rng(5)
    big = (rng.standard_normal(300_001) * 3e4).astype(np.float32)  # some beyond F16's 65504
    header = {
        "big": {"dtype": "F32", "shape": [300_001], "data_offsets": [0, 1_200_004]},
        "norm": {"dtype": "F32", "shape": [3], "data_offsets": [1_200_004, 1_200_016]},
        "step": {"dtype": "I64", "shape": [1], "data_offsets": [1_200_016, 1_200_024]},
    }
    data = big.tobytes() + np.float32([1, 2, 3]).tobytes() + np.int64(9).tobytes()
    return raw_file(tmp_path / "m.safetensors", header, data)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error when no GPU is present")
def test_cuda_without_gpu_is_a_clear_error(tmp_path):
    proc = cli(
        "rewrite", _checkpoint(tmp_path), "-o", tmp_path / "o.safetensors", "--dtype", "bf16", "--device", "cuda"
    )
    assert proc.returncode == 2
    assert "no usable CUDA device" in proc.stderr and proc.stderr.count("\n") == 1
    assert not (tmp_path / "o.safetensors").exists()


def test_unknown_device_is_refused(tmp_path):
    proc = cli("rewrite", _checkpoint(tmp_path), "-o", tmp_path / "o.safetensors", "--device", "gpu")
    assert proc.returncode == 2 and "'gpu' is not cpu, cuda or cuda:N" in proc.stderr
    assert not (tmp_path / "o.safetensors").exists()


def _source(dtype: str) -> bytes:
    rng = np.random.default_rng(7)
    if dtype in ("F16", "BF16"):
        return ALL_16
    if dtype == "F32":
        return _f32_ties() + (rng.standard_normal(100_003) * 1e4).astype(np.float32).tobytes()
    # F64: values across F32's and F16's ranges and their edges, and raw bit patterns
    scaled = rng.standard_normal(60_000) * 2.0 ** rng.integers(-160, 140, 60_000)
    edges = np.float64([65504, 65519.99, 65520, 3.4028235e38, 3.4028236e38, 2.0**-149, 2.0**-150, 2.0**-24, 2.0**-25])
    words = rng.integers(0, 1 << 63, 40_000, dtype=np.uint64) | rng.integers(0, 2, 40_000, dtype=np.uint64) << 63
    return np.concatenate([scaled, edges, -edges]).tobytes() + words.tobytes()


@needs_gpu
@pytest.mark.parametrize(
    ("src", "dst"), [(s, d) for s in ("F64", "F32", "F16", "BF16") for d in ("F64", "F32", "F16", "BF16") if s != d]
)
def test_cuda_cast_matches_cpu(tmp_path, src, dst):
    # Same bits as torch's CPU Tensor.to for every value but NaN payloads (CUDA writes
    # 0x7FFF for a BF16 NaN where the CPU writes 0x7FC0); the same overflow counts.
    raw = _source(src)
    chunk = 4096 * 3 + 8  # many steps, both slots reused, a short last one
    got, overflow = cast_via_streamck(tmp_path, src, raw, dst, chunk=chunk, device="cuda")
    assert_same_as_torch(got, src, raw, dst)
    _, cpu_overflow = cast_via_streamck(tmp_path, src, raw, dst, chunk=chunk, device="cpu")
    assert overflow == cpu_overflow


@needs_gpu
def test_cli_cuda_rewrite_equals_cpu(tmp_path):
    # No NaN in the data: the whole sharded output is byte-identical to the CPU run's.
    src = _checkpoint(tmp_path)
    common = ["--dtype", "fp16", "--cast", "norm=fp32", "--max-shard-size", "300KB", "--verify", "--json"]
    cpu = cli("rewrite", src, "-o", tmp_path / "cpu", *common)
    gpu = cli("rewrite", src, "-o", tmp_path / "gpu", *common, "--device", "cuda:0")
    assert cpu.returncode == gpu.returncode == 0, gpu.stderr
    assert json.loads(gpu.stdout)["overflow"] == json.loads(cpu.stdout)["overflow"] != {}
    names = sorted(p.name for p in (tmp_path / "cpu").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "gpu").iterdir()) and len(names) > 2
    for name in names:
        assert (tmp_path / "cpu" / name).read_bytes() == (tmp_path / "gpu" / name).read_bytes(), name


@needs_gpu
def test_cuda_run_casts_gathered_views_on_the_cpu(tmp_path):
    from test_torch_sources import tricky_state_dict

    torch.save(tricky_state_dict(), tmp_path / "a.bin")
    for device in ("cpu", "cuda"):
        proc = cli(
            "rewrite",
            tmp_path / "a.bin",
            "-o",
            tmp_path / f"{device}.safetensors",
            "--dtype",
            "bf16",
            "--device",
            device,
        )
        assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "cpu.safetensors").read_bytes() == (tmp_path / "cuda.safetensors").read_bytes()


@needs_gpu
def test_no_race_with_delayed_streams_and_sync_debug(tmp_path, monkeypatch):
    # Each slot's work is delayed on its stream (torch.cuda._sleep), chunks are 1.5 MiB over
    # ~16 steps, and the data never repeats, so a slot refilled, or written out, before its
    # work is done gives wrong bytes. Under sync-debug "error" any implicit synchronisation
    # in the pipeline (a pageable copy, an .item()) is an error.
    n = 6_000_001
    data = (np.random.default_rng(11).standard_normal(n) * 1e3).astype(np.float32)
    header = {"w": {"dtype": "F32", "shape": [n], "data_offsets": [0, data.nbytes]}}
    src = raw_file(tmp_path / "m.safetensors", header, data.tobytes())
    real_stream = torch.cuda.stream

    @contextlib.contextmanager
    def delayed(stream):
        with real_stream(stream):
            torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time before the slot's copies
            yield

    plan = compile_plan(open_checkpoint(src), Rules(dtype="BF16"))
    cpu = write_plan(plan, tmp_path / "out" / "cpu.safetensors", chunk=3 << 19, device="cpu")
    monkeypatch.setattr(torch.cuda, "stream", delayed)
    torch.cuda.set_sync_debug_mode("error")
    try:
        gpu = write_plan(plan, tmp_path / "out" / "gpu.safetensors", chunk=3 << 19, device="cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert gpu.overflow == cpu.overflow
    assert (tmp_path / "out" / "gpu.safetensors").read_bytes() == (tmp_path / "out" / "cpu.safetensors").read_bytes()
