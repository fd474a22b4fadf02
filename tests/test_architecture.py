"""The import structure of harness/ (docs/architecture.md): no import cycle among its modules, counting
every import (function-level and TYPE_CHECKING ones too), and the layers contract of pyproject.toml."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle_in_harness() -> None:
    graph = grimp.build_graph("harness", include_external_packages=False)
    assert len(graph.modules) > 100  # every module of the package was read
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_cycle() -> None:
    """Positive control: a graph with a cycle a -> b -> c -> a (and an acyclic d) is reported."""
    graph = grimp.ImportGraph()
    for name in ("a", "a.b", "a.c", "a.d"):
        graph.add_module(name)
    graph.add_import(importer="a.b", imported="a.c")
    graph.add_import(importer="a.c", imported="a")
    graph.add_import(importer="a", imported="a.b")
    graph.add_import(importer="a.d", imported="a.b")
    assert _cycles(graph) == [["a", "a.b", "a.c"]]


def test_import_contracts_are_kept() -> None:
    """lint-imports with pyproject.toml's contracts (the layers of docs/architecture.md)."""
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Contracts: 8 kept, 0 broken." in done.stdout


MAX_MODULES_PER_FOLDER = 15
MAX_LAYERS = 10


def test_no_folder_holds_more_than_fifteen_modules() -> None:
    """A package's name says what is inside: a folder of harness/ holds at most 15 modules (docs/architecture.md)."""
    crowded = {str(d.relative_to(ROOT)): n for d in (ROOT / "harness").rglob("*") if d.is_dir()
               if (n := len([f for f in d.glob("*.py") if f.name != "__init__.py"])) > MAX_MODULES_PER_FOLDER}
    assert crowded == {}


def test_layers_stay_at_most_ten() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    layers = text[text.index("layers = [\n"):]
    layers = layers[:layers.index("]\n")]
    assert 1 < len([line for line in layers.splitlines() if line.strip().startswith('"harness.')]) <= MAX_LAYERS
