"""Issue #36, messages a newcomer should not have to decode: a file that is not safetensors
says what it looks like; a misspelt flag gets a suggestion and an abbreviation is refused;
the library speaks of ``force=True``, the command line of ``--force``; every data command
takes the same ``-q`` and ``--json``."""

import pickle
import zipfile
from pathlib import Path

import numpy as np
import pytest
from helpers import cli, llama_like, save

import streamck
from streamck import OutputError, Rules, compile_plan, open_checkpoint, write_plan
from streamck.cli_args import build_parser

REPO = Path(streamck.__file__).resolve().parents[1]


def one_line(proc, needle: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert needle in proc.stderr, proc.stderr


def _zip(path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("notes.txt", "not a model")
    return path


def _json(path: Path) -> Path:
    path.write_text('{"architectures": ["LlamaForCausalLM"]}')
    return path


def _pickle(path: Path) -> Path:
    path.write_bytes(pickle.dumps({"weight": [1.0, 2.0]}, protocol=4))
    return path


NOT = "is not a safetensors file: it looks like"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: REPO / "streamck" / "cli.py", f'{NOT} text (\'"""The ``streamck`` command'),
        (lambda d: REPO / "pyproject.toml", f"{NOT} text ('[build-system]')"),
        (lambda d: _zip(d / "model.zip"), "is a zip archive without a data.pkl: not a torch checkpoint, nor"),
        (lambda d: _zip(d / "m.safetensors"), f"{NOT} a zip archive"),
        (lambda d: _pickle(d / "state.pkl"), f"{NOT} a pickle"),
        (lambda d: _pickle(d / "state.safetensors"), f"{NOT} a pickle"),
        (lambda d: REPO / "tests" / "conftest.py", f"{NOT} text"),
        (lambda d: _json(d / "config.json"), f"{NOT} JSON text (a config or an index?"),
    ],
)
def test_not_a_safetensors_file_says_what_it_looks_like(tmp_path, make, message):
    path = make(tmp_path)
    proc = cli("ls", path)
    one_line(proc, f"{path}: {message}")
    assert "header length" not in proc.stderr


def test_a_text_file_named_pt_is_not_called_a_legacy_torch_file(tmp_path):
    (tmp_path / "notes.pt").write_text("x = 1\n")
    proc = cli("ls", tmp_path / "notes.pt")
    one_line(proc, "is not a torch checkpoint (a zip archive): it looks like text ('x = 1')")


def test_a_damaged_safetensors_file_still_gets_its_own_message(tmp_path):
    src = save(tmp_path / "m.safetensors", llama_like())
    (tmp_path / "cut.safetensors").write_bytes(src.read_bytes()[:100])
    one_line(cli("ls", tmp_path / "cut.safetensors"), "runs past the end of the 100-byte file")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["rewrite", "SRC", "--dtpye", "bf16"], "unrecognized arguments: --dtpye bf16; did you mean --dtype?"),
        (["rewrite", "SRC", "--dtyp=bf16"], "unrecognized arguments: --dtyp=bf16; did you mean --dtype?"),
        (["rewrite", "SRC", "--max-shard", "5GB"], "did you mean --max-shard-size?"),
        (["ls", "SRC", "--jsn"], "streamck ls: error: unrecognized arguments: --jsn; did you mean --json?"),
        (["rewrit", "SRC"], "invalid choice: 'rewrit' (choose from 'ls', 'rewrite', 'diff', 'hash', 'completion'); "
                            "did you mean rewrite?"),
        (["rewrite", "SRC", "--format", "safetensor"], "did you mean safetensors?"),
    ],
)  # fmt: skip
def test_a_misspelt_flag_gets_a_suggestion_and_abbreviations_are_refused(tmp_path, args, message):
    src = save(tmp_path / "m.safetensors", llama_like())
    out = ["-o", tmp_path / "out"] if "ls" not in args else []
    proc = cli(*[str(src) if a == "SRC" else a for a in args], *out)
    one_line(proc, message)
    assert not (tmp_path / "out").exists()


def test_abbreviations_are_refused_everywhere():
    parser = build_parser()
    assert parser.allow_abbrev is False
    assert all(sub.allow_abbrev is False for sub in parser.commands.values())


def test_force_is_spelt_as_the_caller_passes_it(tmp_path):
    src = save(tmp_path / "m.safetensors", {"a": np.ones(4, np.float32)})
    out = tmp_path / "o.safetensors"
    plan = compile_plan(open_checkpoint(src), Rules())
    write_plan(plan, out)
    with pytest.raises(OutputError) as library:
        write_plan(plan, out)
    assert str(library.value) == f"{out}: already exists; pass force=True to replace it"
    assert "--force" not in str(library.value)
    one_line(cli("rewrite", src, "-o", out), f"streamck: error: {out}: already exists; pass --force to replace it")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match=r"; pass force=True to write into it \(an earlier export's"):
        write_plan(plan, tmp_path / "dir")
    write_plan(plan, tmp_path / "dir", force=True)
    assert sorted(p.name for p in (tmp_path / "dir").iterdir()) == ["model.safetensors", "notes.txt"]


def test_every_data_command_takes_quiet_and_json():
    """ls, rewrite, diff and hash: the same -q/--quiet (notes that need no action left out) and
    --json; ``completion`` prints a script, neither a report nor notes."""
    parser = build_parser()
    flags = {name: {s for a in sub._actions for s in a.option_strings} for name, sub in parser.commands.items()}
    for name in ("ls", "rewrite", "diff", "hash"):
        assert {"-q", "--quiet", "--json"} <= flags[name], name
        quiet = next(a for a in parser.commands[name]._actions if "-q" in a.option_strings)
        assert quiet.help.startswith("only notes that ask for action"), name
    assert flags["completion"] == {"-h", "--help"}
