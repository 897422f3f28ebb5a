"""The package's layering, read from the source: data flows source → transforms → plan →
writer, and no module imports another in a circle (imports inside functions and type-only
imports count too: a circle says a type lives in the wrong module)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "streamck"
# What each layer may not import.
FORBIDDEN = {
    "streamck.source": (
        "streamck.transforms",
        "streamck.plan",
        "streamck.writer",
        "streamck.check",
        "streamck.api",
        "streamck.cli",
    ),
    "streamck.transforms": ("streamck.plan", "streamck.writer", "streamck.check", "streamck.api", "streamck.cli"),
    "streamck.plan": ("streamck.writer", "streamck.check", "streamck.api", "streamck.cli"),
    "streamck.writer": ("streamck.check", "streamck.api", "streamck.cli"),
    "streamck.check": ("streamck.transforms", "streamck.plan", "streamck.writer", "streamck.api", "streamck.cli"),
}


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p) for p in PACKAGE.rglob("*.py")}


def _names(node: ast.AST) -> list[str]:
    """The streamck modules an import statement loads: ``from pkg import mod`` is ``pkg.mod``
    when that is a module, else ``pkg`` itself."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        return [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module for a in node.names]
    return []


def imports() -> dict[str, set[str]]:
    """Every module's imports of streamck modules, wherever they stand in the file."""
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        graph[_module(path)] = {n for node in ast.walk(tree) for n in _names(node) if n.split(".")[0] == "streamck"}
    return graph


# streamck.storage lies under every layer: it may import only these of streamck.
STORAGE_MAY_IMPORT = ("streamck.storage", "streamck.errors", "streamck.fileio", "streamck.units")


def test_storage_imports_nothing_above_it():
    wrong = [
        f"{mod} imports {dep}"
        for mod, deps in imports().items()
        if mod.startswith("streamck.storage")
        for dep in deps
        if not dep.startswith(STORAGE_MAY_IMPORT)
    ]
    assert wrong == []
    assert any(m.startswith("streamck.storage") for m in MODULES)


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


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    graph = {m: {d for d in deps if d in MODULES and d != m} for m, deps in imports().items()}
    assert cycles(graph) == []


def test_the_cycle_check_finds_a_type_only_circle():
    """The check itself: a circle through an ``if TYPE_CHECKING:`` import is found."""
    a = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from streamck.b import B\n"
    graph = {"streamck.a": set(), "streamck.b": {"streamck.a"}}
    graph["streamck.a"] = {n for node in ast.walk(ast.parse(a)) for n in _names(node) if n.startswith("streamck")}
    assert cycles(graph) == [["streamck.a", "streamck.b"]]


def test_the_writer_never_imports_torch():
    """The writer only writes: torch is the transforms' engines' business."""
    wrong = []
    for path in (PACKAGE / "writer").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            wrong += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "torch"]
    assert wrong == []


def test_plan_top_level_is_shared_machinery():
    """``streamck/plan``'s own modules are the shared machinery; families live in packages."""
    top = sorted(p.stem for p in (PACKAGE / "plan").glob("*.py"))
    assert top == ["__init__", "compile", "contract", "hf_export", "options", "passes", "rules"]


def test_bench_and_scripts_import_no_test_module():
    root = PACKAGE.parent
    tests = {p.stem for p in (root / "tests").glob("*.py")}
    offenders = []
    for path in [*root.glob("bench/**/*.py"), *root.glob("scripts/*")]:  # bench/cases/ too
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
    "streamck.plan.eagle3.plan",
    "streamck.plan.eagle4.plan",
    "streamck.plan.hf_export",
    "streamck.plan.megatron.plan",
    "streamck.plan.torchtitan.plan",
    "streamck.source.dcp.native",
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
        "assert not loaded() and 'streamck.source.zero.files' not in sys.modules, f'import streamck.api: {loaded()}'\n"
        f"assert main(['ls', {str(ckpt)!r}]) == 0 and not loaded(), f'ls imported {{loaded()}}'\n"
        f"assert main(['rewrite', {str(ckpt)!r}, '-o', {str(tmp_path / 'o')!r}, '--strip-prefix', 'model.']) == 0\n"
        "assert not loaded(), f'a rules rewrite imported {loaded()}'\n"
        "from streamck.plan import BUILTIN_PLANS, megatron_plan\n"
        "assert BUILTIN_PLANS['megatron-gpt'] is megatron_plan and 'streamck.plan.megatron.plan' in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# The one module that runs the families' passes in order (as source's dispatch modules tell formats apart).
PLAN_DISPATCH = {"streamck.plan.passes"}


def test_no_plan_family_imports_another():
    """The built-in plans share their checks through streamck.plan.contract (and the
    trainer exports through hf_export; MoE expert layouts through streamck.plan.moe, shared
    machinery that every trainer's export uses), never by importing another family's modules."""
    shared = {"moe"}

    def family(mod: str) -> str | None:
        parts = mod.split(".")
        return parts[2] if len(parts) > 3 and parts[1] == "plan" and parts[2] not in shared else None

    wrong = [
        f"{mod} imports {dep}"
        for mod, deps in imports().items()
        if mod.startswith("streamck.plan.") and mod not in PLAN_DISPATCH
        for dep in deps
        if family(dep) is not None and family(dep) != family(mod)
    ]
    assert wrong == []


# streamck/source: the index and the machinery every format reads through at the top, one
# package per format family beneath it. torchzip is shared: every torch-format family's files
# are torch.save archives. Only the modules that tell which format a path holds know the families.
SOURCE_FAMILIES = {"dcp", "torchzip", "verl", "zero"}
SOURCE_SHARED_FAMILIES = {"torchzip"}
SOURCE_DISPATCH = {"checkpoint", "layout", "steps"}
LONGEST_FUNCTION = 70  # lines: one screen, read in a sitting


def _source_family(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[2] if len(parts) > 3 and parts[1] == "source" else None


def test_source_families_are_packages():
    packages = {p.parent.name for p in (PACKAGE / "source").glob("*/__init__.py")}
    assert packages == SOURCE_FAMILIES
    top = {p.stem for p in (PACKAGE / "source").glob("*.py")}
    assert SOURCE_DISPATCH <= top and not top & SOURCE_FAMILIES


def test_no_source_family_imports_another():
    """A format family reads through the shared machinery (and torch archives through
    torchzip), never through another family's modules."""
    wrong = [
        f"{mod} imports {dep}"
        for mod, deps in imports().items()
        if _source_family(mod)
        for dep in deps
        if _source_family(dep) not in (None, _source_family(mod), *SOURCE_SHARED_FAMILIES)
    ]
    assert wrong == []


def test_source_machinery_imports_no_family():
    """The index, readers and shared checks sit beneath the families: only the modules that
    tell which format a path holds (SOURCE_DISPATCH) import them."""
    wrong = [
        f"{mod} imports {dep}"
        for mod, deps in imports().items()
        if mod.startswith("streamck.source.")
        and not _source_family(mod)
        and mod.split(".")[2] not in SOURCE_DISPATCH | SOURCE_FAMILIES
        for dep in deps
        if _source_family(dep) and _source_family(dep) not in SOURCE_SHARED_FAMILIES
    ]
    assert wrong == []


def long_functions(root: Path, limit: int) -> list[str]:
    """Every function (or method) of the modules under ``root`` longer than ``limit`` lines."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_functions_fit_on_a_screen():
    """The whole package, writer and CLI included (#49; source/ first, #40)."""
    assert long_functions(PACKAGE, LONGEST_FUNCTION) == []


MOST_PARAMETERS = 8  # past this, the options belong on an object (WriteOptions, PlanOptions, SourceSpec)


def many_parameters(root: Path, limit: int) -> list[str]:
    """Every function of the modules under ``root`` taking more than ``limit`` parameters
    (``self`` and ``cls`` not counted; ``*args``/``**kwargs`` not counted)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                a = node.args
                names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs) if x.arg not in ("self", "cls")]
                if len(names) > limit:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({len(names)} parameters)")
    return found


def test_no_function_takes_more_than_eight_parameters():
    assert many_parameters(PACKAGE, MOST_PARAMETERS) == []


def test_the_parameter_check_finds_a_long_signature(tmp_path):
    (tmp_path / "m.py").write_text(
        "def f(a, b, c, d, e, f, g, h, i):\n    pass\n\n\ndef g(self, *, a, b, c, d, e, f, g, h):\n    pass\n"
    )
    found = many_parameters(tmp_path, MOST_PARAMETERS)
    assert len(found) == 1 and " f (9 parameters)" in found[0]


def test_the_length_check_finds_a_long_function(tmp_path):
    (tmp_path / "m.py").write_text("def f():\n" + "    x = 1\n" * LONGEST_FUNCTION + "\n\ndef g():\n    pass\n")
    found = long_functions(tmp_path, LONGEST_FUNCTION)
    assert len(found) == 1 and " f (71 lines)" in found[0]
