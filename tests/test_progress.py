"""Issue #36: progress a batch job can see. Where stderr is not a terminal (a Slurm or
Kubernetes job's log file), a line at a steady pace (bytes done of the total, rate, time
left, the tensor being written); ``--progress auto|bar|log|none``. The pace is checked
against a fake clock, never the wall clock."""

import io
import re

import numpy as np
import pytest
from helpers import cli, llama_like, read_all, save

from streamck import Rules, compile_plan, open_checkpoint, write_plan
from streamck.errors import UsageError
from streamck.writer.progress import Bar, Log, Silent, reporter

MiB = 1 << 20


class Clock:
    """A clock that moves only when told to (``step`` seconds per reading, or by ``advance``)."""

    def __init__(self, step: float = 0.0):
        self.now, self.step = 1000.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_a_line_every_ten_seconds_with_rate_eta_and_tensor():
    clock, out = Clock(), io.StringIO()
    log = Log(100 * MiB, out, clock)
    log.tensor("model.embed_tokens.weight")
    for _ in range(9):  # 9 s, 9 MiB: no line yet
        clock.now += 1
        log(MiB)
    assert out.getvalue() == ""
    clock.now += 1
    log(MiB)  # 10 s, 10 MiB
    line = out.getvalue().splitlines()[-1]
    assert line == (
        "streamck: progress: 10.00 MiB of 100.00 MiB (10%), 1.00 MiB/s, ETA 0:01:30, 0:00:10 elapsed, "
        "writing model.embed_tokens.weight"
    )
    log.tensor("lm_head.weight")
    clock.now += 5
    log(40 * MiB)  # 15 s since the start, 5 since the last line: none
    assert out.getvalue().count("\n") == 1
    clock.now += 5
    log(0)  # 20 s: 50 MiB at 2.5 MiB/s, 50 MiB left
    assert out.getvalue().splitlines()[-1] == (
        "streamck: progress: 50.00 MiB of 100.00 MiB (50%), 2.50 MiB/s, ETA 0:00:20, 0:00:20 elapsed, "
        "writing lm_head.weight"
    )


def test_nothing_written_yet_has_no_eta():
    clock = Clock()
    log = Log(MiB, io.StringIO(), clock)
    clock.now += 30
    assert log.line(clock.now) == "streamck: progress: 0 B of 1.00 MiB (0%), 0 B/s, ETA unknown, 0:00:30 elapsed"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_auto_is_a_bar_on_a_terminal_and_log_lines_elsewhere():
    assert isinstance(reporter(10, "auto", io.StringIO()), Log)
    bar = reporter(10, "auto", Terminal())
    assert isinstance(bar, Bar)
    bar.close()
    assert type(reporter(10, "none", io.StringIO())) is Silent and type(reporter(10, False)) is Silent
    assert isinstance(reporter(10, "log", Terminal()), Log)
    with pytest.raises(UsageError, match="^progress loud: one of auto, bar, log, none$"):
        reporter(10, "loud")


def test_the_writer_reports_every_byte_and_each_tensor(tmp_path):
    """A real write, its reporter on a clock that moves 10 s per reading: a line per update,
    the bytes adding up to the output's, and the tensors named in the order written."""
    tensors = {f"t{i}": np.full(40_000, i, np.float32) for i in range(3)}
    src = save(tmp_path / "src.safetensors", tensors)
    plan = compile_plan(open_checkpoint(src), Rules(dtype="F16"))
    out = io.StringIO()
    log = Log(plan.total_size, out, Clock(step=10.0))
    write_plan(plan, tmp_path / "o.safetensors", progress=log, chunk=16_000)
    assert log.done == plan.total_size == 3 * 40_000 * 2
    lines = out.getvalue().splitlines()
    assert len(lines) > 3
    named = [re.search(r"writing (\S+)$", line)[1] for line in lines]
    assert named == sorted(named) and set(named) == set(tensors)
    assert lines[-1].startswith("streamck: progress: 234.38 KiB of 234.38 KiB (100%)")
    written = read_all(tmp_path / "o.safetensors")
    assert all(np.array_equal(v, tensors[k].astype(np.float16)) for k, v in written.items())


def test_cli_progress_modes(tmp_path, monkeypatch, capsys):
    """The command's choice of reporter: auto is log lines where stderr is no terminal (here),
    -q and --progress none show nothing, bar is tqdm's even on a pipe. Lines come every
    LOG_EVERY seconds: 0 here, so that each update writes one."""
    import streamck.writer.progress as wp
    from streamck.cli import main

    monkeypatch.setattr(wp, "LOG_EVERY", 0.0)
    src = save(tmp_path / "src.safetensors", llama_like())

    def stderr(name: str, *args: str) -> str:
        capsys.readouterr()
        assert main(["rewrite", str(src), "-o", str(tmp_path / name), *args]) == 0
        return capsys.readouterr().err

    for name, args in (("auto", ()), ("log", ("--progress", "log"))):
        lines = [line for line in stderr(name, *args).splitlines() if line.startswith("streamck: progress: ")]
        assert lines and "(100%)" in lines[-1] and "writing model." in lines[-1], lines
    bar = stderr("bar", "--progress", "bar")
    assert "progress:" not in bar and "B/s" in bar  # tqdm's, even on a pipe: asked for
    for quiet in (["-q"], ["--progress", "none"]):
        err = stderr(quiet[-1], *quiet)
        assert "streamck: progress:" not in err and "B/s" not in err
    refused = cli("rewrite", src, "-o", tmp_path / "d", "--progress", "lg", check=2).stderr
    assert "invalid choice: 'lg'" in refused and "did you mean log?" in refused


def test_time_left_goes_at_each_kind_of_work_own_rate():
    """Issue #43: fast copies, then a slow quantization: the time left is the quantization's
    bytes at its own rate, not at the copies' (which foretold 16 s here)."""
    clock, out = Clock(), io.StringIO()
    log = Log(200 * MiB, out, clock, kinds={"a": ("copy", 100 * MiB), "b": ("Fp8", 100 * MiB)})
    log.tensor("a")
    clock.now += 10
    log(100 * MiB)
    log.tensor("b")
    clock.now += 10
    log(10 * MiB)  # 1 MiB/s: 90 MiB left
    assert "ETA 0:01:30" in out.getvalue().splitlines()[-1]


def test_verify_is_part_of_the_work_and_named():
    """--verify re-reads every tensor: its bytes count toward the total, the line says what is verified."""
    clock, out = Clock(), io.StringIO()
    log = Log(10 * MiB, out, clock, verify=True)
    log.tensor("w")
    clock.now += 10
    log(10 * MiB)
    assert "10.00 MiB of 20.00 MiB (50%)" in out.getvalue() and "ETA 0:00:10" in out.getvalue()
    log.phase("verifying")
    log.tensor("w")
    clock.now += 10
    log(5 * MiB)
    # the re-read goes at its own pace: 5 MiB in 10 s, 5 MiB left
    assert out.getvalue().splitlines()[-1].endswith("(75%), 768.00 KiB/s, ETA 0:00:10, 0:00:20 elapsed, verifying w")


def test_a_batch_log_keeps_coming_while_no_byte_arrives():
    """A long computation before a tensor's first bytes (an NVFP4 global scale, a verify of a
    slow transform): the log thread still writes a line each period."""
    import time

    out = io.StringIO()
    log = Log(MiB, out, every=0.1, beat=True)
    log.tensor("model.layers.0.mlp.experts.gate_up_proj")
    deadline = time.monotonic() + 30
    while out.getvalue().count("\n") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    log.close()
    lines = out.getvalue().splitlines()
    assert len(lines) >= 2 and all("0 B of 1.00 MiB" in line for line in lines)
    assert lines[-1].endswith("writing model.layers.0.mlp.experts.gate_up_proj")


def test_a_verified_write_reports_its_re_read(tmp_path):
    tensors = {f"t{i}": np.full(40_000, i, np.float32) for i in range(3)}
    src = save(tmp_path / "src.safetensors", tensors)
    plan = compile_plan(open_checkpoint(src), Rules(dtype="F16"))
    out = io.StringIO()
    log = Log(plan.total_size, out, Clock(step=10.0), verify=True)
    write_plan(plan, tmp_path / "o.safetensors", progress=log, chunk=16_000, verify=True)
    assert log.done == 2 * plan.total_size
    lines = out.getvalue().splitlines()
    assert any(line.endswith("verifying t2") for line in lines) and "(100%)" in lines[-1]
