"""Issue #49: library errors name the library's parameters, the command line words them as flags.

A message holds a mark (``{merge_lora}``, streamck.errors.OPTIONS): ``str(err)`` says
``merge_lora`` to a Python caller, ``err.cli()`` says ``--merge-lora`` (what streamck.cli
prints). Here: every error message in the package uses marks, not raw flags; every mark is a
real flag on one side and a real library name on the other; and one plan-side refusal reads
each way, from the library and from the command line.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import functools
import inspect
import json
import re
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
from helpers import cli, save

import streamck
from streamck.cli_args import build_parser
from streamck.errors import OPTIONS
from streamck.plan.options import PlanOptions
from streamck.plan.rules import KINDS
from streamck.spec import SourceSpec
from streamck.writer.options import WriteOptions

PACKAGE = Path(streamck.__file__).resolve().parent
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*(?![\w-])")
# Functions that build an error from the message they are given (their argument is error text).
MESSAGE_HELPERS = {"refuse", "refuse_other", "require_torch"}
# Raw flags allowed in an error message, by file or folder under streamck/ (a prefix of the
# path): each is about the command line itself. None so far.
EXCEPTIONS: dict[str, set[str]] = {}


@functools.cache
def cli_actions() -> dict[str, argparse.Action]:
    """Every long option of every streamck subcommand, with its parser action."""
    found: dict[str, argparse.Action] = {}

    def walk(parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            found.update((s, action) for s in action.option_strings if s.startswith("--"))
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    walk(sub)

    walk(build_parser())
    return {flag: action for flag, action in found.items() if flag not in ("--help", "--version")}


def cli_flags() -> set[str]:
    return set(cli_actions())


def _called(node: ast.Call) -> str:
    return node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")


def _is_error_call(node: ast.AST) -> bool:
    """A call that makes an error from its arguments: a non-builtin ``*Error`` class, or a MESSAGE_HELPERS function."""
    if not isinstance(node, ast.Call):
        return False
    name = _called(node)
    return name in MESSAGE_HELPERS or (name.endswith("Error") and not hasattr(builtins, name))


def _scopes(tree: ast.Module) -> list[ast.AST]:
    return [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))]


def _own_nodes(scope: ast.AST):
    """The nodes of ``scope`` outside the functions nested in it."""
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            stack.extend(ast.iter_child_nodes(node))


def _assigned(scope: ast.AST) -> dict[str, list[ast.AST]]:
    """name -> the statements that set it in ``scope`` (``x = …``, ``x += …``, ``x[k] = …``,
    ``for x, y in …``: the loop's iterable)."""
    out: dict[str, list[ast.AST]] = {}
    for node in _own_nodes(scope):
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets, value = [node.target], node
        elif isinstance(node, ast.For):
            targets, value = [node.target], node.iter
        else:
            continue
        for t in targets:
            bases = [t.value] if isinstance(t, ast.Subscript) else t.elts if isinstance(t, ast.Tuple) else [t]
            for base in bases:
                if isinstance(base, ast.Name):
                    out.setdefault(base.id, []).append(value)
    return out


def _names(node: ast.AST) -> set[str]:
    """The names ``node`` reads for its value: a condition's (``a if note else b``) are not text."""
    stack, out = [node], set()
    while stack:
        n = stack.pop()
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.IfExp):
            stack += [n.body, n.orelse]
        else:
            stack.extend(ast.iter_child_nodes(n))
    return out


def message_literals(source: str) -> list[tuple[int, str]]:
    """(line, text) of every string literal that can end up in an error message of ``source``:
    in an error call's arguments, or set (in the same function, or at module level) on a name
    those arguments use, followed through the names that value uses in turn; docstrings aside."""
    tree = ast.parse(source)
    module = _assigned(tree)
    parts: list[ast.AST] = []
    for scope in _scopes(tree):
        local = _assigned(scope) if scope is not tree else {}
        calls = [n for n in _own_nodes(scope) if _is_error_call(n)]
        todo = [a for c in calls for a in [*c.args, *(k.value for k in c.keywords)]]
        seen: set[str] = set()
        while todo:
            node = todo.pop()
            parts.append(node)
            for name in _names(node) - seen:
                seen.add(name)
                todo += local.get(name) or module.get(name, [])
    found = {
        (n.lineno, n.value)
        for part in parts
        for n in ast.walk(part)
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }
    return sorted(found)


def raw_flags(source: str, flags: set[str]) -> list[tuple[int, str]]:
    """(line, flag) of each streamck flag written raw in an error message of ``source``."""
    return [(line, f) for line, text in message_literals(source) for f in FLAG.findall(text) if f in flags]


def test_the_walk_finds_a_raw_flag_however_the_message_is_built():
    """The checker itself: a raw flag reached directly, through a name, a dict key and a module
    constant is found; marks, docstrings, notices and other tools' flags are not."""
    source = '''
"""Module docstring with --dtype."""
HINT = "drop --keep-shards"

def f(x):
    """Docstring naming --plan."""
    flags = {"--safe-merge": x}
    stray = [k for k in flags]
    for flag, _ in (("--zero", 1),):
        raise UsageError(f"{flag} given")
    what = f"--step {x}"
    notices.append("--key is only a notice")
    if x:
        raise PlanError(f"{what}: {stray} applies to {{merge_lora}} only; {HINT}")
    raise UsageError("pip install --index-url somewhere; {dtype}")
'''
    found = sorted(f for _, f in raw_flags(source, cli_flags()))
    assert found == ["--keep-shards", "--safe-merge", "--step", "--zero"]


@functools.cache  # one walk of the package for the tests below
def _package_raw_flags() -> dict[str, set[tuple[int, str]]]:
    """file (under streamck/) -> (line, flag) of its error messages' raw flags; the CLI's own
    modules left out (the command line's text: flags are its words)."""
    flags, out = cli_flags(), {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if not rel.startswith("cli"):
            out[rel] = set(raw_flags(path.read_text(), flags))
    return out


def _allowed(rel: str, flag: str) -> bool:
    return any(rel.startswith(where) and flag in flags for where, flags in EXCEPTIONS.items())


def test_no_error_message_in_the_package_writes_a_raw_flag():
    """Error text in streamck says options through marks (EXCEPTIONS aside)."""
    offenders = [
        f"{rel}:{line}: {flag}"
        for rel, found in _package_raw_flags().items()
        for line, flag in sorted(found)
        if not _allowed(rel, flag)
    ]
    assert offenders == []


def _library_names() -> set[str]:
    """What a library caller passes: the options objects' fields, streamck.diff's keywords, the rules' kinds."""
    diff = set(inspect.signature(streamck.diff).parameters)
    return {f.name for c in (SourceSpec, PlanOptions, WriteOptions) for f in fields(c)} | diff | set(KINDS)


@pytest.mark.parametrize("mark", sorted(OPTIONS))
def test_every_mark_is_a_flag_and_a_library_name(mark):
    library, flag = OPTIONS[mark]
    assert flag in cli_flags()
    name, _, value = library.partition("=")
    assert name in _library_names()
    if value:  # a flag whose library spelling is a value (experts="keep", force=True): the flag sets it
        action = cli_actions()[flag]
        assert (action.dest, repr(action.const)) == (name, value.replace('"', "'"))


def _ia3_adapter(tmp_path: Path) -> tuple[Path, Path]:
    src = save(tmp_path / "in.safetensors", {"model.w": np.ones((2, 3), np.float32)})
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3"}))
    return src, adapter


def test_a_plan_side_refusal_says_merge_lora_to_python_and_flag_to_the_shell(tmp_path):
    """streamck.plan.lora's refusal of a non-LoRA adapter: ``merge_lora`` from the library,
    ``--merge-lora`` from the command line, the rest of the line the same."""
    src, adapter = _ia3_adapter(tmp_path)
    with pytest.raises(streamck.PlanError) as caught:
        streamck.build_plan(src, merge_lora=adapter, merge_engine="numpy")  # numpy: no torch import to wait for
    said = str(caught.value)
    assert said.endswith(": is a IA3 adapter; merge_lora merges LoRA adapters only"), said
    assert "--" not in said
    out = tmp_path / "out"
    proc = cli("rewrite", src, "-o", out, "--merge-lora", adapter, "--merge-engine", "numpy", check=2)
    assert proc.stderr == f"streamck: error: {said.replace('merge_lora', '--merge-lora')}\n"
    assert not out.exists()


def test_an_options_refusal_names_the_fields_to_python_and_the_flags_to_the_shell(tmp_path):
    """PlanOptions' own check: ``safe_merge applies to merge_lora only``; ``--safe-merge …``."""
    with pytest.raises(streamck.UsageError, match=r"^safe_merge applies to merge_lora only$"):
        PlanOptions(safe_merge=True)
    src = save(tmp_path / "in.safetensors", {"w": np.ones(2, np.float32)})
    proc = cli("rewrite", src, "-o", tmp_path / "out", "--safe-merge", check=2)
    assert proc.stderr == "streamck: error: --safe-merge applies to --merge-lora only\n"
