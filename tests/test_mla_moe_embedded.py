"""The embedded engine runs an MLA + MoE model (tiny-dsv2-moe) over real gloo ranks: at tp2ep2 each rank holds two
of the four experts (their full columns) and half the shared expert's columns; the layout check holds every rank's
experts and every expert tensor's slice against the MoE plan, and the logits agree with tp1. With the router
renormalizing over each rank's own experts (fault moe-router-local-renorm) the cell FAILs as silent corruption."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from harness.cli import main
from harness.core.jsonio import read_json
from harness.records.results import results_cells

RUN = ["run", "--suite", "mla", "--model", "tiny-dsv2-moe", "--topo", "tp2ep2", "--workload", "prompts"]


def _cell(tmp: Path, name: str, *extra: str) -> tuple[int, dict[str, Any]]:
    out = tmp / name
    code = main([*RUN, "--out", str(out), "--cache-dir", str(tmp / "cache"), *extra])
    return code, next(c for c in results_cells(out) if c["topology"] == "tp2ep2")


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mla-moe")


def test_mla_moe_at_tp2ep2_passes_with_each_rank_holding_its_experts(tmp: Path) -> None:
    code, cell = _cell(tmp, "clean")
    assert code == 0 and cell["status"] == "PASS", cell["checks"]
    checks = {c["name"]: c for c in cell["checks"]}
    assert checks["features_on"]["verdict"] == "PASS" and "2 ranks route 2-2 of 4 experts" in checks["features_on"][
        "reason"]
    ranks = read_json(Path(cell["run_dir"]) / "layout.json")["target"]["ranks"]
    assert [r["experts"]["experts"] for r in ranks] == [[0, 1], [2, 3]]
    assert [r["experts"]["shared_columns"] for r in ranks] == [64, 64]
    assert all(r["experts"]["expert_columns"] == 128 for r in ranks)
    held = {r["rank"]: r["params"]["layers.1.experts.gate.weight"]["slice"] for r in ranks}
    assert held == {0: [[[0, 2]], [[0, 128]], [[0, 256]]], 1: [[[2, 4]], [[0, 128]], [[0, 256]]]}


def test_a_router_renormalized_per_rank_fails_as_silent_corruption(tmp: Path) -> None:
    code, cell = _cell(tmp, "fault", "--fault", "moe-router-local-renorm")
    assert code == 1 and cell["status"] == "FAIL" and cell["silent_corruption"], cell["checks"]
    failed = {c["name"] for c in cell["checks"] if c["verdict"] == "FAIL"}
    assert "logits_prefill" in failed and "layout" not in failed
