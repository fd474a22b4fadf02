"""Disaggregated prefill/decode end to end over real gloo worlds: clean cells pass every check (negative
controls: a GQA model tp4 -> tp2dcp2 with GCD-duplicated prefill KV heads, an MLA model), each pd fault is a
FAIL of the checks named for it (positive controls), and the load conditions (a lost stored entry, failing
first reads) are absorbed: the cell passes with its retries and recomputes counted and every pool balanced."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.pd_support import PD_CHECKS, cache_fixture, checks_of, pd_suite, run_cells, suite_fixture

suite_file = suite_fixture(pd_suite("pdt", ["tiny-gqa", "tiny-mla"], ["tp4>tp2dcp2"]), "pdt")
cache_dir = cache_fixture()
_run, _checks = run_cells, checks_of


def test_clean_pd_cells_pass_every_check(tmp_path: Path, suite_file: Path, cache_dir: Path) -> None:
    code, cells = _run(tmp_path / "r", suite_file, cache_dir)
    assert code == 0, [(c["model"], [ch["reason"] for ch in c["checks"] if ch["verdict"] != "PASS"]) for c in cells]
    assert {c["model"] for c in cells} == {"tiny-gqa", "tiny-mla"}
    for cell in cells:
        checks = _checks(cell)
        for name in (*PD_CHECKS, "logits_decode", "generation"):
            assert checks[name]["verdict"] == "PASS", (cell["model"], name, checks[name]["reason"])
        assert checks["pd_transfer"]["metrics"]["rows_checked"] > 0
        assert checks["pd_transfer"]["metrics"]["mismatches"] == 0


@pytest.mark.parametrize(("fault", "topo", "failing"), [
    ("pd-head-offset", "tp2>tp1", {"pd_transfer", "logits_decode"}),
    ("pd-gqa-replication", "tp4>tp2", {"pd_transfer", "logits_decode"}),
    ("pd-block-owner", "tp4>tp2dcp2", {"pd_transfer", "logits_decode"}),
    ("pd-early-release", "tp2>tp2", {"pd_transfer", "logits_decode"}),
    ("pd-recompute-offset", "tp2>tp2", {"pd_load", "logits_decode"}),
    ("pd-unbounded-retry", "tp2>tp2", {"pd_load"}),
    ("pd-decode-unloaded", "tp2>tp2", {"pd_load", "pd_transfer"}),
])
def test_each_pd_fault_fails_its_checks_naming_where(tmp_path: Path, suite_file: Path, cache_dir: Path, fault: str,
                                                      topo: str, failing: set[str]) -> None:
    code, cells = _run(tmp_path / "r", suite_file, cache_dir, "--fault", fault, "--topo", topo, "--model", "tiny-gqa")
    assert code == 1
    (cell,) = cells
    checks = _checks(cell)
    failed = {name for name, ch in checks.items() if ch["verdict"] == "FAIL"}
    assert failing <= failed, (fault, {n: checks[n]["reason"] for n in failing})
    assert "request " in checks[sorted(failing & set(PD_CHECKS))[0]]["reason"]
    if "pd_transfer" in failing:
        reason = checks["pd_transfer"]["reason"]
        assert "decode rank" in reason and ("layer" in reason or "positions" in reason), reason
    if fault == "pd-unbounded-retry":
        assert "load attempts, the policy bounds them at 3" in checks["pd_load"]["reason"]
        assert "block(s) meanwhile" in checks["pd_load"]["reason"]


@pytest.mark.parametrize(("condition", "retried", "recomputed"), [("pd-load-lost", True, True),
                                                                  ("pd-load-flaky", True, False)])
def test_load_conditions_are_absorbed_with_balanced_pools(tmp_path: Path, suite_file: Path, cache_dir: Path,
                                                          condition: str, retried: bool, recomputed: bool) -> None:
    code, cells = _run(tmp_path / "r", suite_file, cache_dir, "--fault", condition, "--topo", "tp2>tp2",
                       "--model", "tiny-gqa")
    (cell,) = cells
    checks = _checks(cell)
    assert code == 0, {n: ch["reason"] for n, ch in checks.items() if ch["verdict"] != "PASS"}
    load = checks["pd_load"]
    assert (load["metrics"]["retried"] > 0) == retried and (load["metrics"]["recomputed"] > 0) == recomputed
    assert load["metrics"]["lost_entries"] == ([1] if condition == "pd-load-lost" else [])
    assert "every pool balanced" in load["reason"]


def test_an_error_reported_under_a_lock_is_a_hang_with_the_stuck_rank_stack(tmp_path: Path, suite_file: Path,
                                                                           cache_dir: Path) -> None:
    """The deadlock never waits forever: the load's watchdog names the hang, dumps every thread's stack into the
    rank's log and ends the rank; the cell is an ERROR saying so."""
    code, cells = _run(tmp_path / "r", suite_file, cache_dir, "--fault", "pd-error-under-lock", "--topo", "tp2>tp2",
                       "--model", "tiny-gqa")
    assert code == 3
    (cell,) = cells
    (check,) = cell["checks"]
    assert check["verdict"] == "ERROR" and "KVLoadHangError" in check["reason"]
    assert "request 1" in check["reason"] and "past its deadline" in check["reason"]
    logs = "".join(p.read_text() for p in (tmp_path / "r" / "runs").rglob("rank*.log"))
    assert "in _report" in logs and "in _attempts" in logs  # the stuck rank's stack: reporting under the lock
