"""The house's shape, held by CI: imports only point one way, and no room grows past what one can read.

ARCHITECTURE.md draws harness/ as layers (cli -> analysis -> run -> backends -> net); a cycle anywhere means two
modules cannot be understood apart, so every import (at module level, inside functions and under TYPE_CHECKING
alike) counts.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOP_LEVEL_MODULES_MAX = 10
MODULE_LINES_MAX = 600
FUNCTION_LINES_MAX = 80
ANALYSIS = "harness.analysis"
EXPERIMENTS = "harness.analysis.experiments"  # the one part of analysis that starts runs
RUNNER = "harness.run.runner"


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources(*packages: str) -> dict[str, Path]:
    return {_module_name(p): p for package in packages for p in sorted((REPO / package).rglob("*.py"))}


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of `modules` that `path` imports, wherever in the file the import stands (relative imports
    resolved against its package)."""
    package = path.relative_to(REPO).parent.parts
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else ()
            module = ".".join([*base, *([node.module] if node.module else [])])
            # `from harness.run import runner` imports the module harness.run.runner, not only the package.
            names = [module] + [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in modules}
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), or a module importing itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_among_harness_and_trainers_modules():
    sources = _sources("harness", "trainers")
    graph = {name: _imports(path, set(sources)) - {name} for name, path in sources.items()}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_trainers_import_nothing_of_harness():
    sources = _sources("harness", "trainers")
    harness_modules = {name for name in sources if name.split(".")[0] == "harness"}
    offenders = {
        name: sorted(_imports(path, harness_modules)) for name, path in sources.items() if name.startswith("trainers")
    }
    assert {name: found for name, found in offenders.items() if found} == {}


def test_analysis_outside_experiments_starts_no_runs():
    """ARCHITECTURE.md: analysis only reads run folders, and what starts runs is harness/analysis/experiments/ (the
    sweep executor, compare's sweeps, regime matching's closed loop, the reference code's and the gate's runs). So no
    module of harness/analysis/ outside it imports the runner or anything in experiments/, the sweep executor
    included; what a run needs checked (the link emulator) is passed in by experiments/."""
    sources = _sources("harness")
    experiments = {name for name in sources if name == EXPERIMENTS or name.startswith(f"{EXPERIMENTS}.")}
    starts_runs = experiments | {RUNNER}
    readers = {name: path for name, path in sources.items() if name.startswith(ANALYSIS) and name not in experiments}
    offenders = {name: sorted(_imports(path, starts_runs)) for name, path in readers.items()}
    assert {name: found for name, found in offenders.items() if found} == {}
    # The check sees what it must refuse: the executor itself imports the runner.
    assert RUNNER in _imports(sources[f"{EXPERIMENTS}.sweep"], starts_runs)
    assert len(readers) > 10


def test_harness_has_few_modules_at_its_top_level():
    top = sorted(p.name for p in (REPO / "harness").glob("*.py") if p.name != "__init__.py")
    assert len(top) <= TOP_LEVEL_MODULES_MAX, top


@pytest.mark.parametrize("package", ["harness", "trainers"])
def test_no_module_is_longer_than_one_can_read(package):
    long = {
        str(p.relative_to(REPO)): n
        for p in (REPO / package).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MODULE_LINES_MAX
    }
    assert long == {}


@pytest.mark.parametrize("package", ["harness", "trainers", "compose", "scripts"])
def test_no_function_is_longer_than_one_screen_and_a_half(package):
    long = []
    for path in sorted((REPO / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > FUNCTION_LINES_MAX:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []
