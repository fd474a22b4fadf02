"""What keys a cached reference run: the engine's own code and weights, never the compare code.

`code_hash` follows the imports of an entry module (`harness.backends.embedded.worker` for the embedded engine)
through the package, statically, so the hash covers exactly the modules that produce the artifacts;
editing a check, the report or the CLI leaves every cached reference valid.
"""

from __future__ import annotations

import ast
import hashlib
from pathlib import Path
from typing import Iterator

from harness.core.paths import PROJECT_ROOT

PACKAGE = "harness"
# the comparing side: checks, verdicts, statistics, report and CLI never shape a run's artifacts
# (the engine borrows a helper or a constant from some of them; editing those still keeps the cache)
COMPARE_SIDE: tuple[str, ...] = ("harness.compare", "harness.report", "harness.cli", "harness.checks",
                                 "harness.core.verdict", "harness.baselines.baseline", "harness.gsm8k.stats",
                                 "harness.gsm8k.checks", "harness.checks.gsm8k")


def _compare_side(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in COMPARE_SIDE)


def _module_file(root: Path, module: str) -> Path | None:
    """The source file of `harness.x.y` under `root` (the folder holding the package), or None."""
    parts = module.split(".")
    base = root.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


# the statements that hold statements: an import is a statement, so the walk never enters an expression
_BLOCKS: tuple[str, ...] = ("body", "orelse", "finalbody", "handlers", "cases")
_SEEN: dict[bytes, frozenset[str]] = {}  # a file's contents -> the harness modules it imports (once per process)


def _statements(tree: ast.AST) -> Iterator[ast.AST]:
    """Every statement of `tree` at any depth (function and class bodies, branches, handlers, match cases)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for name in _BLOCKS:
            todo.extend(getattr(node, name, None) or ())


def _imports(path: Path) -> frozenset[str]:
    """Every `harness.*` module `path` imports, at any depth of the file (lazy imports included); parsed once
    per process for each content (the reference cache asks for several entries' closures, which share files)."""
    data = path.read_bytes()
    if data not in _SEEN:
        _SEEN[data] = _parse_imports(data, path)
    return _SEEN[data]


def _parse_imports(data: bytes, path: Path) -> frozenset[str]:
    out: set[str] = set()
    for node in _statements(ast.parse(data, filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == PACKAGE)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == PACKAGE:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)  # `from harness import x` (a module)
    return frozenset(out)


def import_closure(entry: str, root: Path = PROJECT_ROOT) -> list[Path]:
    """The source files of `entry` and every harness module it imports, transitively, sorted; the
    comparing side (COMPARE_SIDE) is left out, and a package's __init__ counts only when imported
    itself (its re-exports are not followed)."""
    seen: dict[str, Path] = {}
    todo = [entry]
    while todo:
        module = todo.pop()
        if module in seen or _compare_side(module):
            continue
        path = _module_file(root, module)
        if path is None:  # `from harness.x import name`: a name, not a module
            continue
        seen[module] = path
        todo.extend(_imports(path))
    return sorted(set(seen.values()))


def code_hash(entry: str, root: Path = PROJECT_ROOT) -> str:
    """sha256 over the relative paths and contents of import_closure(entry)."""
    h = hashlib.sha256()
    for path in import_closure(entry, root):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()
