"""Issue #36: ``streamck completion bash|zsh|fish``, generated from the parser. The bash script
is sourced in a real bash and asked what it completes, as bash asks when TAB is pressed;
the zsh and fish scripts are checked by their shells where installed."""

import os
import shutil
import subprocess

import pytest
from helpers import cli

from streamck.cli_args import build_parser
from streamck.plan import PLAN_FUNCTIONS
from streamck.registry import FORMATS as _FORMATS

FORMATS = sorted(f.name for f in _FORMATS)  # safetensors, torch, gguf: what --format offers


@pytest.fixture(scope="module")
def bash_script(tmp_path_factory):
    path = tmp_path_factory.mktemp("completion") / "streamck.bash"
    path.write_text(cli("completion", "bash", check=0).stdout)
    return path


def complete(script, line: str, cwd=None) -> list[str]:
    """What bash completes for ``line`` (the cursor at its end), through the function that
    ``complete -p streamck`` says is registered for the command."""
    words = line.split(" ")
    program = f"""
source {script}
spec=$(complete -p streamck) || exit 3
[[ $spec =~ -F\\ ([^ ]+) ]] || exit 4
COMP_WORDS=({" ".join(f"'{w}'" for w in words)})
COMP_CWORD={len(words) - 1}
COMP_LINE='{line}'
COMP_POINT={len(line)}
"${{BASH_REMATCH[1]}}" streamck '{words[-1]}' '{words[-2]}'
printf '%s\\n' "${{COMPREPLY[@]}}"
"""
    proc = subprocess.run(["bash", "--norc", "--noprofile", "-c", program], capture_output=True, text=True, cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    return sorted(filter(None, proc.stdout.splitlines()))


def test_bash_completes_commands_and_flags(bash_script):
    assert complete(bash_script, "streamck rew") == ["rewrite"]
    assert complete(bash_script, "streamck rewrite --dt") == ["--dtype"]
    assert complete(bash_script, "streamck rewrite ck/ --dr") == ["--drop", "--drop-cache", "--dry-run"]
    assert complete(bash_script, "streamck ls --js") == ["--json"]
    assert complete(bash_script, "streamck ") == sorted(["ls", "rewrite", "diff", "hash", "completion", "--help",
                                                          "-h", "--version"])  # fmt: skip


def test_bash_completes_choices_plans_and_paths(bash_script, tmp_path):
    assert complete(bash_script, "streamck rewrite ck/ --format ") == FORMATS  # every format of the registry
    assert complete(bash_script, "streamck rewrite ck/ --progress ") == ["auto", "bar", "log", "none"]
    assert complete(bash_script, "streamck completion ") == ["bash", "fish", "zsh"]
    assert complete(bash_script, "streamck diff a b --plan eagle") == sorted(p for p in PLAN_FUNCTIONS if "eagle" in p)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "model.safetensors").write_bytes(b"")
    (tmp_path / "plan.toml").write_text("")
    assert complete(bash_script, "streamck ls run/mo", cwd=tmp_path) == ["run/model.safetensors"]
    assert complete(bash_script, "streamck rewrite run -o ru", cwd=tmp_path) == ["run"]
    assert complete(bash_script, "streamck rewrite run --plan pl", cwd=tmp_path) == ["plan.toml"]
    # Issue #43: the values of --dtype and --quantize complete (no files for them)
    assert complete(bash_script, "streamck rewrite run --dtype b", cwd=tmp_path) == ["bf16", "bfloat16"]
    assert "fp16" in complete(bash_script, "streamck rewrite run --dtype ", cwd=tmp_path)
    assert complete(bash_script, "streamck rewrite run --quantize NV", cwd=tmp_path) == ["NVFP4A16"]
    assert complete(bash_script, "streamck rewrite run --quantize ", cwd=tmp_path) == sorted(
        ["FP8_DYNAMIC", "FP8_BLOCK", "NVFP4A16", "MXFP4A16"]
    )


def test_every_option_is_in_every_script():
    """Generated from the parser: each command's every flag is in each shell's script."""
    parser = build_parser()
    scripts = {shell: cli("completion", shell, check=0).stdout for shell in ("bash", "zsh", "fish")}
    for name, sub in parser.commands.items():
        for flag in (s for a in sub._actions for s in a.option_strings):
            fish = f"-l {flag[2:]}" if flag.startswith("--") else f"-s {flag[1:]}"
            assert f"__fish_seen_subcommand_from {name}' {fish}" in scripts["fish"], (name, flag)
            assert flag in scripts["bash"] and flag in scripts["zsh"], (name, flag)


def _needs(shell: str) -> None:
    """Skip where ``shell`` is missing, unless scripts/test installed it (then a failure)."""
    if shutil.which(shell) is None:
        if os.environ.get("STREAMCK_REQUIRE_SHELLS"):
            pytest.fail(f"{shell} is not installed, though scripts/test installs it (STREAMCK_REQUIRE_SHELLS)")
        pytest.skip(f"{shell} is not installed here")


@pytest.mark.parametrize("shell", ["zsh", "fish"])
def test_zsh_and_fish_scripts_parse(shell, tmp_path):
    _needs(shell)
    script = tmp_path / f"streamck.{shell}"
    script.write_text(cli("completion", shell, check=0).stdout)
    proc = subprocess.run([shell, "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_fish_completes_as_bash_does(tmp_path):
    _needs("fish")
    script = tmp_path / "streamck.fish"
    script.write_text(cli("completion", "fish", check=0).stdout)

    def fish(line: str) -> list[str]:
        proc = subprocess.run(["fish", "--no-config", "-c", f"source {script}; complete -C '{line}'"],
                              capture_output=True, text=True, cwd=tmp_path)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return sorted(w.split("\t")[0] for w in proc.stdout.splitlines())

    assert fish("streamck rew") == ["rewrite"]
    assert fish("streamck rewrite --dt") == ["--dtype"]
    assert fish("streamck rewrite x --format ") == FORMATS
    assert fish("streamck completion ") == ["bash", "fish", "zsh"]
