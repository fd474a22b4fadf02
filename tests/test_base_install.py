"""The README's first command installs only the base dependencies (`pip install -e .`): a default suite's run must
need nothing from an extra. A module of an extra's distribution (lm-eval, pandas, fastapi, tokenizers, ...) that a
default cell imports would make its cells ERROR on a fresh machine while every test here, run with the test extras,
passes (scipy once was such a module). So a run here hides every module that only an extra brings, in every process
it starts, and must still give each cell a verdict."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from harness.records.results import results_cells

ROOT = Path(__file__).resolve().parents[1]
TOML = pytest.importorskip("tomllib", reason="pyproject.toml is read with tomllib (Python 3.11+)")
BLOCKER = '''import importlib.abc, sys
HIDDEN = frozenset({hidden!r})
class _Hidden(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {{name!r}} (an extra's module, hidden)", name=name)
        return None
sys.meta_path.insert(0, _Hidden())
'''


def _closure(requirements: list[str]) -> set[str]:
    """The installed distributions `requirements` pull in, transitively (extras of theirs left out)."""
    seen: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = req.name.lower().replace("_", "-")
        if name in seen or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        seen.add(name)
        todo += [Requirement(r) for r in dist.requires or ()]
    return seen


def _extra_only_modules() -> frozenset[str]:
    """The top-level modules whose every distribution comes only with an extra of pyproject.toml (the source's
    declaration, which a fresh `pip install -e .` installs; an older editable install's metadata may lag it)."""
    project = TOML.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = _closure(project["dependencies"])
    extras = [r for reqs in project["optional-dependencies"].values() for r in reqs
              if Requirement(r).name != project["name"]]
    extra_only = _closure(extras) - base
    owners = metadata.packages_distributions()
    return frozenset(m for m, dists in owners.items()
                     if dists and all(d.lower().replace("_", "-") in extra_only for d in dists))


@pytest.fixture(scope="module")
def base_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("base-install")
    (folder / "sitecustomize.py").write_text(BLOCKER.format(hidden=sorted(_extra_only_modules())))
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def test_the_hidden_set_is_what_the_extras_alone_bring(base_env: dict[str, str]) -> None:
    """The control: lm-eval, pandas and fastapi cannot be imported under the blocker; torch, scipy, numpy can."""
    hidden = _extra_only_modules()
    assert {"lm_eval", "pandas", "fastapi", "tokenizers"} <= hidden
    assert not {"torch", "scipy", "numpy", "yaml", "jinja2", "httpx", "safetensors"} & hidden
    probe = "import importlib, sys\nfor m in sys.argv[1:]:\n    try: importlib.import_module(m); print(m, 'ok')\n" \
            "    except ImportError: print(m, 'hidden')\n"
    out = subprocess.run([sys.executable, "-c", probe, "pandas", "lm_eval", "scipy.stats", "torch"], env=base_env,
                         capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[:4] == ["pandas hidden", "lm_eval hidden", "scipy.stats ok", "torch ok"], out


@pytest.mark.slow
def test_a_default_suite_runs_on_the_base_dependencies_alone(tmp_path: Path, base_env: dict[str, str]) -> None:
    """The README's first command's suite and topology (one of its models, every default workload, sampling
    included): each cell has a verdict and none is an ERROR, with every extra's module hidden."""
    proc = subprocess.run([sys.executable, "-m", "harness", "run", "--suite", "dcp", "--topo", "tp4dcp4", "--model",
                           "tiny-gqa", "--out", str(tmp_path / "r"), "--cache-dir", str(tmp_path / "cache")],
                          env=base_env, capture_output=True, text=True, timeout=900)
    statuses = [(c["workload"], c["status"]) for c in results_cells(tmp_path / "r")]
    assert proc.returncode == 0 and len(statuses) == 5 and {s for _, s in statuses} == {"PASS"}, \
        (statuses, proc.stderr[-3000:])
