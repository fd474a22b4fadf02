"""Reruns of a run's failed cells (`harness run --rerun-failed RUN_DIR`): which cells, and the merged result.

A cell is rerun when it FAILed, ERRORed or was not run (a stopped run's "not_run" cells, and cells of the run's
plan absent from its results: a shard that never reported). The merged result holds every cell of the first run;
each rerun cell is its latest attempt plus the check `rerun` that names every attempt's status. A cell that
failed and then passed is a WARN of that check ("passed on retry"): visible, never silently green; a cell that
fails again keeps its failing status; a cell that was not run before and passes now is a PASS. The attempts are
also in the cell's details ("attempts": status, reason and run folder of each).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Iterable, Sequence

from harness.core.verdict import CellResult, CheckResult, Verdict
from harness.records.cells import cell_id

RERUN_CHECK = "rerun"
_FAILED = (Verdict.FAIL, Verdict.ERROR)
_PASSED = (Verdict.PASS, Verdict.WARN)


def result_id(cell: CellResult) -> str:
    """The cell id (harness/records/cells.py) of a result."""
    return cell_id(cell.suite, cell.model, cell.topology, cell.fault, cell.seed, cell.workload)


def to_rerun(cells: Sequence[CellResult], planned: Iterable[str]) -> list[str]:
    """The ids to run again: failed, errored or not-run cells, then planned cells the results lack, in order."""
    have = {result_id(c) for c in cells}
    failed = [result_id(c) for c in cells if c.status in _FAILED]
    return failed + [i for i in planned if i not in have]


def _attempt(cell: CellResult) -> dict[str, Any]:
    worst = next((c for c in cell.checks if c.verdict is cell.status and c.name != RERUN_CHECK), None)
    return {"status": "not run" if cell.not_run else cell.status.value,
            "reason": worst.reason if worst is not None and cell.status is not Verdict.PASS else "",
            "run_dir": cell.run_dir}


def with_attempts(first: CellResult | None, again: CellResult) -> CellResult:
    """`again` (the rerun's result) carrying the attempts before it (`first`'s, None: absent from the run)."""
    attempts: list[dict[str, Any]] = []
    if first is not None:
        attempts = list(first.details.get("attempts") or [_attempt(first)])
    else:
        attempts = [{"status": "not run", "reason": "absent from the run's results", "run_dir": ""}]
    attempts.append(_attempt(again))
    earlier_failed = any(a["status"] in ("FAIL", "ERROR") for a in attempts[:-1])
    status = again.status
    if status in _PASSED and earlier_failed:
        verdict, head = Verdict.WARN, "passed on retry after failing: "
    elif status in _FAILED:
        verdict, head = status, "failed again: " if earlier_failed else ""
    else:
        verdict, head = Verdict.PASS if status in _PASSED else status, ""
    said = "; ".join(f"attempt {n}: {a['status']}" + (f" ({a['reason'].splitlines()[0][:160]})" if a["reason"] else "")
                     for n, a in enumerate(attempts, 1))
    checks = tuple(c for c in again.checks if c.name != RERUN_CHECK) + (CheckResult(RERUN_CHECK, verdict, head + said,
                                                                                     {"attempts": len(attempts)}),)
    return replace(again, checks=checks, details={**again.details, "attempts": attempts})


def merge_attempts(first: Sequence[CellResult], again: Sequence[CellResult]) -> list[CellResult]:
    """Every cell of `first`, the rerun ones replaced by their attempts (with_attempts), in `first`'s order;
    rerun cells `first` lacked after them."""
    rerun = {result_id(c): c for c in again}
    out = []
    for cell in first:
        new = rerun.pop(result_id(cell), None)
        out.append(cell if new is None else with_attempts(cell, new))
    return out + [with_attempts(None, c) for c in rerun.values()]
