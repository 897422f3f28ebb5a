"""The write side as the read side (#49): formats and destinations behind small interfaces,
options as objects, one path from the CLI; and what that made room for: the source never
written over (#55 items 1, 2), an output in a bucket whole or not at all (#55 item 3), side
files streamed (#55 item 8), odd sizes refused in one line (#55 item 10), and a closing line
that says what happened (#54 items 6, 8)."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
from helpers import cli, llama_like, save, save_sharded

import streamck
from streamck import OutputError, PlanOptions, SourceSpec, UsageError, WriteOptions
from streamck.registry import BUILTINS, FORMATS


@pytest.fixture
def src(tmp_path):
    return save(tmp_path / "src.safetensors", llama_like(layers=2, hidden=16, vocab=32))


def test_rewrite_takes_three_objects_and_at_most_six_parameters(src, tmp_path):
    assert len(inspect.signature(streamck.rewrite).parameters) <= 6
    one = streamck.rewrite(
        SourceSpec(src), tmp_path / "a", plan_options=PlanOptions(dtype="bf16"),
        write_options=WriteOptions(max_shard_size="4KB", verify=True),
    )  # fmt: skip
    two = streamck.rewrite(src, tmp_path / "b", dtype="bf16", max_shard_size=4000, verify=True)  # the old keywords
    assert [f.name for f in one.files] == [f.name for f in two.files] and len(one.files) > 2
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(one.files, two.files, strict=True))
    with pytest.raises(UsageError, match="unknown option.*max_shard"):
        streamck.rewrite(src, tmp_path / "c", max_shard=5)


@pytest.mark.parametrize(
    ("field", "value", "library", "flag"),
    [
        ("header_align", 12, "header_align 12: must be a positive multiple of 8", "--header-align 12"),
        ("max_shard_size", "1e400GB", "max_shard_size '1e400GB'", "--max-shard-size '1e400GB'"),
        ("max_shard_size", "99999999999999999999999TB", "past the largest file size", "--max-shard-size"),
        ("part", "3/2", "K/N", "--part"),
    ],
)
def test_options_are_checked_where_made_and_named_as_the_caller_spells_them(src, tmp_path, field, value, library, flag):
    """A library caller reads the parameter's name, the command line the flag (#49 item 3); a
    size past any disk is one line, not a traceback (#55 item 10)."""
    with pytest.raises(UsageError) as e:
        WriteOptions(**{field: value})
    assert library in str(e.value) or library in e.value.cli()
    proc = cli("rewrite", src, "-o", tmp_path / "o", f"--{field.replace('_', '-')}", str(value))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and flag.split()[0] in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "o").exists()


def test_the_cli_calls_streamck_rewrite_with_the_three_objects(src, tmp_path, monkeypatch):
    import streamck.api
    from streamck.cli import main

    seen = {}

    def fake(source, output, *, plan_options, write_options, on_plan):
        seen.update(source=source, plan=plan_options, write=write_options)
        raise SystemExit(0)

    monkeypatch.setattr(streamck.api, "rewrite", fake)
    with pytest.raises(SystemExit):
        main(["rewrite", str(src), "-o", str(tmp_path / "o"), "--dtype", "bf16", "--strict", "--progress", "log"])
    assert isinstance(seen["source"], SourceSpec) and seen["plan"].dtype == "bf16"
    assert seen["write"] == WriteOptions(strict=True, progress="log")


def test_the_registry_is_what_the_help_and_the_formats_offer():
    """One table of built-in plans and formats (#49 item 4): the help names every plan that
    writes something, --format offers every format, the lookup imports each on demand."""
    from streamck.plan import PLAN_FUNCTIONS
    from streamck.writer import formats

    helps = cli("rewrite", "--help", check=0).stdout.replace("\n", " ")
    helps = " ".join(helps.split())
    for b in BUILTINS:
        assert PLAN_FUNCTIONS[b.name] == (b.module, b.function)
        assert not b.writes or b.name in helps, b.name
    assert f"{{{','.join(f.name for f in FORMATS)}}}" in helps
    assert {f.name: type(formats.get(f.name)).__name__ for f in FORMATS} == {f.name: f.cls for f in FORMATS}


def test_hash_never_writes_over_its_source(tmp_path):
    """``hash SRC -o SRC`` (or a shard of the source folder) replaced the weights with the manifest (#55 item 1)."""
    folder = save_sharded(tmp_path / "m", llama_like(layers=2, hidden=16, vocab=32), 2)
    shard = sorted(folder.glob("*.safetensors"))[0]
    before = shard.read_bytes()
    for target, source in ((shard, shard), (shard, folder), (folder / "sub" / ".." / shard.name, folder)):
        proc = cli("hash", source, "-o", target)
        assert proc.returncode == 2 and "refusing to write over the source" in proc.stderr, proc.stderr
        assert shard.read_bytes() == before
    cli("hash", folder, "-o", tmp_path / "digests.txt", check=0)
    assert len((tmp_path / "digests.txt").read_text().splitlines()) == len(llama_like(layers=2, hidden=16, vocab=32))


def test_stdout_appended_to_the_source_is_refused_before_a_byte(src):
    """``rewrite SRC -o - >> SRC``: the shell appended to the source while it was read (#55 item 2)."""
    before = src.read_bytes()
    cmd = f'"{sys.executable}" -m streamck rewrite "{src}" -o - >> "{src}"'
    proc = subprocess.run(cmd, shell=True, capture_output=True, text=True)
    assert proc.returncode == 2 and "stdout is the source file" in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1 and src.read_bytes() == before


def test_the_closing_line_says_what_was_done_and_how_long_it_took(src, tmp_path):
    """Copied, cast, verified, and the seconds it took (#54 item 8); a bare size under 1 MiB is
    noted as bytes (#54 item 6)."""
    done = cli("rewrite", src, "-o", tmp_path / "a", "--dtype", "bf16", "--verify", check=0).stderr.splitlines()[-1]
    assert done.startswith("wrote ") and " s (" in done and "cast to bf16" in done and done.endswith(", verified")
    done = cli("rewrite", src, "-o", tmp_path / "b", "--cast", "*norm*=f16", check=0).stderr.splitlines()[-1]
    assert "copied" in done.split(": ")[-1] and "cast to f16" in done and "verified" not in done
    proc = cli("rewrite", src, "-o", tmp_path / "c", "--max-shard-size", "5", "--dry-run", check=0)
    assert "--max-shard-size 5 is 5 bytes; write 5MB or 5GB" in proc.stderr


def test_a_format_a_destination_cannot_take_is_refused_in_one_line(src, tmp_path):
    with pytest.raises(UsageError, match="streams one safetensors file; write a torch archive"):
        streamck.rewrite(src, "-", format="torch")
    with pytest.raises(OutputError, match="max_shard_size needs a directory output"):
        streamck.rewrite(src, tmp_path / "o.safetensors", max_shard_size="1KB")
    assert not (tmp_path / "o.safetensors").exists()


def test_a_writer_refusal_names_the_parameter_not_the_flag(src, tmp_path):
    """#49 item 3: the library caller passed keep_shards=True, not --keep-shards."""
    with pytest.raises(UsageError) as e:
        streamck.rewrite(src, tmp_path / "o", keep_shards=True, max_shard_size=1000)
    assert str(e.value) == "keep_shards keeps the source's files; drop max_shard_size"
    assert e.value.cli() == "--keep-shards keeps the source's files; drop --max-shard-size"


@pytest.mark.parametrize("dry", [[], ["--dry-run"]])
def test_a_format_whose_extra_is_missing_is_one_line(src, tmp_path, dry):
    """``pip install .`` alone, then ``-o model.gguf``: the packages to install named in one line,
    exit 2, nothing written, --dry-run alike (it was an ImportError's traceback, exit 1)."""
    code = "import sys; sys.modules['gguf'] = None\nfrom streamck.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    out = tmp_path / "model.gguf"
    proc = subprocess.run([sys.executable, "-c", code, "rewrite", str(src), "-o", str(out), *dry],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "gguf output needs gguf, which is not installed: pip install gguf" in proc.stderr
    assert not out.exists()
