"""The matrix launches the next cell while a cell's checks run (embedded engine, Runner._launch_ahead): the
verdicts, every check's verdict and metrics, are those of the cells run one after the other, for a faulty
matrix (FAILs and SKIPs) and a clean one; an HTTP engine's runs stay one at a time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from harness.cli import build_parser
from harness.cli.run import build_request
from harness.core.verdict import CellResult
from harness.flow.runner import Runner

DCP = ["run", "--suite", "dcp", "--model", "tiny-gqa", "--topo", "tp2dcp2,tp2,tp4dcp2", "--workload",
       "prompts,lengths"]


def _runner(tmp_path: Path, *extra: str, out: str = "out") -> Runner:
    args = build_parser().parse_args([*DCP, *extra, "--out", str(tmp_path / out),
                                      "--cache-dir", str(tmp_path / "cache")])
    return Runner(build_request(args), progress=lambda _: None)


def _verdicts(cells: list[CellResult]) -> list[tuple[Any, ...]]:
    return [(c.topology, c.seed, c.workload, c.status.value,
             tuple((k.name, k.verdict.value, k.reason) for k in c.checks)) for c in cells]


@pytest.mark.parametrize("fault", [None, "dcp-lse-merge"])
def test_launching_ahead_gives_the_verdicts_of_cells_run_one_after_another(tmp_path: Path, fault: str | None) -> None:
    extra = ("--fault", fault) if fault else ()
    ahead = _runner(tmp_path, *extra)
    assert ahead._launch_ahead()
    overlapped = ahead.run()
    alone = _runner(tmp_path, *extra, out="alone")  # the same cache: the same reference and noise runs
    one_by_one = [r for cell in alone.planned() for r in
                  (lambda got: got if isinstance(got, list) else alone.per_workload(cell, got))(alone.run_cell(cell))]
    assert _verdicts(overlapped) == _verdicts(one_by_one)
    statuses = {(c.topology, c.status.value) for c in overlapped}
    if fault:  # a positive control: the DCP cells FAIL, tp2 (no DCP) is a SKIP
        assert statuses == {("tp2dcp2", "FAIL"), ("tp4dcp2", "FAIL"), ("tp2", "SKIP")}
    else:
        assert statuses == {("tp2dcp2", "PASS"), ("tp4dcp2", "PASS"), ("tp2", "PASS")}
    assert len(overlapped) == 6  # 3 cells x 2 workloads


def test_an_http_engine_runs_one_cell_at_a_time(tmp_path: Path) -> None:
    assert not _runner(tmp_path, "--engine", "harness-serve")._launch_ahead()
