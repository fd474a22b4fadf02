"""acceptance_per_position end to end on the embedded engine (`harness run --suite spec`, tiny-gqa tp4-mtp
and tp4dcp4-draft, the keys of the shipped acceptance baselines): clean cells pass every position (negative
control); a verify step that never accepts the last draft (spec-verify-last-draft, shared with the tp1
reference, so only the baseline can see it) fails position 3 as performance-only; without a stored baseline
a stale drafter cache (draft-stale-kv) fails against 0.95 x the reference's per-position rates."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.cli import main
from harness.records.results import results_cells

pytestmark = pytest.mark.xdist_group("spec-positions")  # one cache: references run once


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("spec-positions-cache")


def _cell(out: Path, cache: Path, topo: str, *extra: str) -> tuple[int, dict, dict]:
    code = main(["run", "--suite", "spec", "--kv-budget-mib", "8", "--max-seq-len", "256", "--model", "tiny-gqa",
                 "--seed", "0", "--topo", topo, "--out", str(out), "--cache-dir", str(cache), *extra])
    (cell,) = results_cells(out)
    return code, cell, {c["name"]: c for c in cell["checks"]}


@pytest.mark.slow
def test_clean_cells_pass_every_draft_position_against_the_baseline(tmp_path: Path, cache: Path) -> None:
    code, _, checks = _cell(tmp_path / "clean", cache, "tp4-mtp")
    got = checks["acceptance_per_position"]
    assert code == 0 and got["verdict"] == "PASS", got["reason"]
    assert "from the stored baseline" in got["reason"]
    assert [p["position"] for p in got["metrics"]["positions"]] == [1, 2, 3]
    assert checks["features_on"]["verdict"] == "PASS" and "speculator (mtp) on" in checks["features_on"]["reason"]


@pytest.mark.slow
def test_a_never_accepted_last_draft_fails_position_3_as_performance(tmp_path: Path, cache: Path) -> None:
    code, cell, checks = _cell(tmp_path / "fault", cache, "tp4-mtp", "--fault", "spec-verify-last-draft")
    got = checks["acceptance_per_position"]
    assert code == 1 and cell["failure_class"] == "performance" and not cell["silent_corruption"]
    assert got["verdict"] == "FAIL" and got["performance_only"], got
    assert got["reason"].startswith("draft position 3: acceptance 0.000 < threshold"), got["reason"]
    assert [p["verdict"] for p in got["metrics"]["positions"]] == ["PASS", "PASS", "FAIL"]
    assert checks["acceptance"]["verdict"] == "PASS"  # the reference has the bug too


@pytest.mark.slow
def test_without_a_baseline_the_floor_is_095_x_the_reference(tmp_path: Path, cache: Path) -> None:
    empty = tmp_path / "no-baselines"
    empty.mkdir()
    code, _, checks = _cell(tmp_path / "fault", cache, "tp4dcp4-draft", "--fault", "draft-stale-kv",
                            "--baselines-dir", str(empty))
    got = checks["acceptance_per_position"]
    assert code == 1 and got["verdict"] == "FAIL", got["reason"]
    assert got["reason"].startswith("draft position 2:") and "0.95 x the reference run's rate" in got["reason"]
    assert checks["acceptance_baseline"]["verdict"] == "SKIP"
