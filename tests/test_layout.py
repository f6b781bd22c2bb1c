"""The code's shape: imports run one way, no cycles, no module too long to read in one sitting.

``experiments`` (the science) never imports ``sweep`` (the harness). Inside ``sweep``, the three
jobs - ``sweep.run`` (train cells), ``sweep.report`` (tables and figures), ``sweep.eval``
(benchmark scores) - import ``experiments`` and the shared base (``sweep.grid``, ``sweep.gridfile``,
``sweep.store``, ``sweep.studies``, ``sweep.signals``), never one another, and nothing imports the
entry points (``sweep.cli``, ``sweep.browse``) or the operational scripts of ``tools`` (outside
the installed package).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support import ROOT

PACKAGES = ("experiments", "sweep", "tools")
JOBS = ("sweep.run", "sweep.report", "sweep.eval")
ENTRY_POINTS = ("sweep.cli", "sweep.browse", "tools")
MAX_LINES = 400


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def _imports(name: str) -> set[str]:
    """Our modules that ``name`` imports anywhere in its file (function-level imports included)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, one level up per extra dot
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {t for t in targets if t in MODULES and t != name}
    return found


GRAPH = {name: _imports(name) for name in MODULES}


def _entry(name: str) -> bool:
    return any(name == e or name.startswith(e + ".") for e in ENTRY_POINTS)


def _owner(name: str) -> str | None:
    return next((job for job in JOBS if name == job or name.startswith(job + ".")), None)


def test_the_science_never_imports_the_harness() -> None:
    offenders = {
        m: sorted(t for t in GRAPH[m] if t.startswith("sweep")) for m in GRAPH if m.startswith("experiments")
    }
    assert {m: t for m, t in offenders.items() if t} == {}


def test_run_report_and_eval_never_import_each_other_or_the_entry_points() -> None:
    crossings = {}
    for module, targets in GRAPH.items():
        job = _owner(module)
        for target in targets:
            other = _owner(target)
            if _entry(target) and not _entry(module):
                crossings[module] = target
            elif job and other and other != job:
                crossings[module] = target
    assert crossings == {}


def test_no_import_cycles() -> None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(GRAPH[module]):
            if state.get(target) == 1:
                cycle = path[path.index(target) :] + [target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_is_longer_than_a_sitting(module: str) -> None:
    assert len(MODULES[module].read_text().splitlines()) <= MAX_LINES


def test_the_graph_sees_real_imports() -> None:
    """The checks above mean something only if the scan finds the imports we know exist."""
    assert "experiments.config" in GRAPH["experiments.gating"]
    assert "sweep.store" in GRAPH["sweep.run.runner"]
    assert "sweep.run.driver" in GRAPH["sweep.cli"]  # a function-level import counts too
