"""The package's layering, read from the source: data flows source → plan → writer, and no
two modules import each other (lazy imports inside functions count too)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "streamck"
# What each layer may not import.
FORBIDDEN = {
    "streamck.source": ("streamck.plan", "streamck.writer", "streamck.check", "streamck.api", "streamck.cli"),
    "streamck.plan": ("streamck.writer", "streamck.check", "streamck.api", "streamck.cli"),
    "streamck.writer": ("streamck.check", "streamck.api", "streamck.cli"),
    "streamck.check": ("streamck.plan", "streamck.writer", "streamck.api", "streamck.cli"),
}


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("streamck"):
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("streamck"))
        graph[_module(path)] = found
    return graph


def test_layers_import_only_downstream():
    wrong = [
        f"{mod} imports {dep}"
        for mod, deps in imports().items()
        for layer, banned in FORBIDDEN.items()
        if mod.startswith(layer)
        for dep in deps
        if dep.startswith(banned)
    ]
    assert wrong == []


def test_no_import_cycles():
    graph = imports()
    modules = set(graph)

    def resolve(dep: str) -> str | None:  # streamck.source imports streamck.source.header: a package edge
        return dep if dep in modules else None

    edges = {
        m: {d for d in map(resolve, deps) if d and d != m and not m.startswith(d + ".")} for m, deps in graph.items()
    }
    cycles = []
    for start in edges:
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in edges.get(node, ()):
                if nxt == start and len(path) > 1 and not all(p == start or start.startswith(p) for p in path):
                    cycles.append(" -> ".join([*path, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    # A package's __init__ re-exporting its own modules is not a cycle of behaviour.
    real = [
        c
        for c in cycles
        if not all(c.split(" -> ")[0].split(".")[:2] == p.split(".")[:2] for p in c.split(" -> ")) or "writer.cast" in c
    ]
    assert real == []


def test_bench_and_scripts_import_no_test_module():
    root = PACKAGE.parent
    tests = {p.stem for p in (root / "tests").glob("*.py")}
    offenders = []
    for path in [*root.glob("bench/*.py"), *root.glob("scripts/*")]:
        if path.suffix not in ("", ".py") or not path.is_file():
            continue
        try:
            tree = ast.parse(path.read_text())
        except SyntaxError:
            continue  # a shell script
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in tests]
    assert offenders == []


# The built-in plans' modules and the trainers' readers only they need.
PLAN_MODULES = (
    "streamck.plan.eagle3",
    "streamck.plan.eagle4",
    "streamck.plan.hf_export",
    "streamck.plan.megatron",
    "streamck.plan.torchtitan",
    "streamck.source.distcp",
)


def test_plans_are_imported_when_asked_for(tmp_path):
    """``import streamck.api``, ``ls`` and a rules rewrite import no built-in plan; naming one does.
    (``ls`` reads the ZeRO file names as any source's layout detection does.)"""
    import subprocess
    import sys

    import numpy as np
    from safetensors.numpy import save_file

    ckpt = tmp_path / "m.safetensors"
    save_file({"model.a": np.ones(3, np.float32)}, ckpt)
    code = (
        "import sys; import streamck.api; from streamck.cli import main\n"
        f"plans = {PLAN_MODULES!r}\n"
        "def loaded(): return sorted(set(plans) & set(sys.modules))\n"
        "assert not loaded() and 'streamck.source.zero_files' not in sys.modules, f'import streamck.api: {loaded()}'\n"
        f"assert main(['ls', {str(ckpt)!r}]) == 0 and not loaded(), f'ls imported {{loaded()}}'\n"
        f"assert main(['rewrite', {str(ckpt)!r}, '-o', {str(tmp_path / 'o')!r}, '--strip-prefix', 'model.']) == 0\n"
        "assert not loaded(), f'a rules rewrite imported {loaded()}'\n"
        "from streamck.plan import BUILTIN_PLANS, megatron_plan\n"
        "assert BUILTIN_PLANS['megatron-gpt'] is megatron_plan and 'streamck.plan.megatron' in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_no_plan_imports_another_plan():
    """The built-in plans share their checks through streamck.plan.contract (and the
    trainer exports through hf_export), never by importing one another."""
    from streamck.plan import PLAN_FUNCTIONS

    plans = {module for module, _ in PLAN_FUNCTIONS.values()}
    wrong = [
        f"{mod} imports {dep}"
        for mod, deps in imports().items()
        if mod.startswith("streamck.plan.")
        for dep in deps
        if dep in plans and dep != mod
    ]
    assert wrong == []
