"""Backend registry and identity: built-ins, entry points, and a cache key that ignores compare code."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from harness.backends.base import backend_record
from harness.backends.build import with_build
from harness.backends.identity import code_hash, import_closure
from harness.backends.registry import ENTRY_POINT_GROUP, available, get_backend
from harness.core.errors import ConfigError
from harness.core.paths import PROJECT_ROOT
from harness.formats.locate import load_model
from harness.records.contract import Backend, Job
from harness.specs.topology import parse_topology_name


def test_builtins_are_backends_and_unknown_names_are_one_error() -> None:
    assert {"embedded", "embedded-topk", "replay"} <= set(available())
    embedded, topk = get_backend("embedded"), get_backend("embedded-topk:8")
    assert isinstance(embedded, Backend) and isinstance(topk, Backend)
    assert embedded.capabilities().has("full_logits") and embedded.capabilities().has("hidden_states")
    assert not topk.capabilities().has("full_logits") and not topk.capabilities().has("hidden_states")
    assert topk.capabilities().top_k == 8 and topk.capabilities().has("topk_logprobs")
    with pytest.raises(ConfigError, match="unknown engine 'embeded'.*did you mean 'embedded'"):
        get_backend("embeded")
    with pytest.raises(ConfigError, match="replay:DIR"):
        get_backend("replay")


def test_a_package_registers_a_backend_through_the_entry_point_group(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "team_backend.py").write_text(
        "from harness.backends.embedded.backend import EmbeddedBackend\n"
        "class TeamBackend(EmbeddedBackend):\n    name = 'team-engine'\n")
    dist = tmp_path / "team_backend-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: team-backend\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nteam-engine = team_backend:TeamBackend\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    info = available()["team-engine"]
    assert info.origin == "team-backend"
    backend = get_backend("team-engine")
    assert backend.name == "team-engine" and isinstance(backend, Backend)
    sys.modules.pop("team_backend", None)


_MINIMAL = ("from harness.records.contract import {base}Capabilities, LaunchResult\n"
            "class {cls}{parent}:\n    name = '{name}'\n"
            "    def __init__(self, option=None): pass\n"
            "    def version(self): return '1'\n"
            "    def capabilities(self): return Capabilities(provides=frozenset())\n"
            "    def identity(self, job): return {{'engine': self.name}}\n"
            "    def skip_reason(self, model, topology): return None\n"
            "    def noise_strategy(self): return 'none'\n"
            "    def run(self, job, timeout_s): return LaunchResult(False, None, 0.0, 'no', {{}})\n")


def test_a_backend_that_lacks_an_optional_feature_inherits_the_default_that_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the required methods: build label '', no engine variables, no engine-side fault, and the
    manifest's backend record names no build. A plugin that does not subclass the protocol is one error
    that says so (it would lack those defaults)."""
    (tmp_path / "bare_backend.py").write_text(
        _MINIMAL.format(base="Backend, ", cls="BareBackend", parent="(Backend)", name="bare")
        + _MINIMAL.format(base="", cls="LooseBackend", parent="", name="loose"))
    dist = tmp_path / "bare_backend-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: bare-backend\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nbare = bare_backend:BareBackend\n"
                                           f"loose = bare_backend:LooseBackend\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        bare = get_backend("bare")
        assert (bare.engine_build(), bare.engine_env(), bare.engine_fault()) == ("", {}, None)
        assert "build" not in backend_record(bare)
        labelled = with_build(bare, "fork-1")
        assert (labelled.engine_build(), labelled.engine_env(), labelled.engine_fault()) == ("fork-1", {}, None)
        with pytest.raises(ConfigError, match="'loose'.*subclass it.*engine_build, engine_env and engine_fault"):
            get_backend("loose")
    finally:
        sys.modules.pop("bare_backend", None)


def _copy_package(tmp_path: Path) -> Path:
    root = tmp_path / "src"
    shutil.copytree(PROJECT_ROOT / "harness", root / "harness", ignore=shutil.ignore_patterns("__pycache__"))
    return root


def test_editing_a_check_keeps_the_engine_identity_editing_the_engine_changes_it(tmp_path: Path) -> None:
    root = _copy_package(tmp_path)
    files = {p.relative_to(root).as_posix() for p in import_closure("harness.backends.embedded.worker", root)}
    assert "harness/engine/layers/dense.py" in files and "harness/partition/layout.py" in files
    assert "harness/cases.py" in files
    assert not any(f.startswith(("harness/compare/", "harness/report/", "harness/cli/")) for f in files)
    before = code_hash("harness.backends.embedded.worker", root)
    for check in ("compare/parity/logits.py", "compare/parity/generation.py", "compare/cell.py", "report/html.py"):
        with open(root / "harness" / check, "a") as f:
            f.write("\n# a tolerance tweak\n")
    assert code_hash("harness.backends.embedded.worker", root) == before
    with open(root / "harness" / "engine" / "layers" / "dense.py", "a") as f:
        f.write("\n# an engine change\n")
    assert code_hash("harness.backends.embedded.worker", root) != before


def test_embedded_identity_names_engine_version_and_weights() -> None:
    model = load_model("tiny-gqa")
    job = Job(model=model, topology=parse_topology_name("tp1"), prompts=["x"], out_dir=".")
    ident = get_backend("embedded").identity(job)
    assert ident["engine"] == "embedded" and ident["version"] and ident["weights"]["spec"]["name"] == "tiny-gqa"
    assert get_backend("embedded-topk").identity(job) != ident  # a top-k-only run is another artifact set
