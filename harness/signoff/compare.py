"""Sign-off: a candidate build's cells against the last signed-off build's (pure functions of results).

A cell is (suite, model, topology, seed); an injected fault belongs to the build, not the cell.
The candidate is BLOCKED when any of its cells FAILs or ERRORs, or a cell of the baseline was not
run for it; otherwise it can be signed off. Skipped checks are listed, never silently green.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from harness.checkmetrics import key_metric, noise_multiples
from harness.errors import ConfigError
from harness.gsm8k.stats import DEFAULT_ALPHA, DEFAULT_BETA, bernoulli_sigma, gate_numbers
from harness.report.merge import merge
from harness.verdict import CellResult, CheckResult, Verdict

CellId = tuple[str, str, str, int]
FAILING = (Verdict.FAIL, Verdict.ERROR)
PAIRED, GATE, ACCEPTANCE = "gsm8k_paired", "gsm8k_baseline", "acceptance"


@dataclass(frozen=True)
class Build:
    """One side of the comparison: its cells by id and its provenance."""

    dirs: tuple[Path, ...]
    cells: dict[CellId, CellResult]
    provenance: dict[str, Any]
    run_id: str


@dataclass(frozen=True)
class CellChange:
    cell: CellId
    old: Verdict | None
    new: Verdict | None
    change: str  # new FAIL | still failing | fixed | unchanged | changed | not checked | new cell | not run
    blocking: bool
    reason: str          # the candidate's first failing check, or why it blocks

    @property
    def label(self) -> str:
        suite, model, topo, seed = self.cell
        return f"{suite}/{model}/{topo}/seed{seed}"


@dataclass(frozen=True)
class MetricDelta:
    cell: CellId
    check: str
    old_verdict: str
    new_verdict: str
    metric: str
    old: float | None
    new: float | None
    unit: str            # "x noise" when both sides are multiples of their noise floors, else "value"


@dataclass(frozen=True)
class Gsm8kRow:
    cell: CellId
    n: int | None
    old_score: float | None
    new_score: float | None
    reference_score: float | None
    b: int | None
    c: int | None
    p_value: float | None
    min_detectable_drop: float | None
    verdict: str


@dataclass(frozen=True)
class AcceptanceRow:
    cell: CellId
    old: float | None
    new: float | None
    reference: float | None
    verdict: str


@dataclass(frozen=True)
class Unchecked:
    cell: CellId
    check: str
    reason: str


@dataclass(frozen=True)
class Signoff:
    candidate: Build
    baseline: Build
    changes: tuple[CellChange, ...]
    deltas: tuple[MetricDelta, ...]
    gsm8k: tuple[Gsm8kRow, ...]
    acceptance: tuple[AcceptanceRow, ...]
    unchecked: tuple[Unchecked, ...]

    @property
    def blocking(self) -> tuple[CellChange, ...]:
        return tuple(c for c in self.changes if c.blocking)

    @property
    def signed_off(self) -> bool:
        return not self.blocking


def cell_id(cell: CellResult) -> CellId:
    return (cell.suite, cell.model, cell.topology, cell.seed)


def load_build(dirs: Sequence[Path], side: str) -> Build:
    """The cells of one build's run folders (merged like `harness report A B`)."""
    if not dirs:
        raise ConfigError(f"--{side} needs at least one run folder")
    cells, provenance, run_id = merge(list(dirs))
    by_id: dict[CellId, CellResult] = {}
    for cell in cells:
        by_id[cell_id(cell)] = cell
    return Build(tuple(dirs), by_id, provenance, run_id)


def _first_problem(cell: CellResult) -> str:
    for check in cell.checks:
        if check.verdict in FAILING:
            return f"{check.name} {check.verdict.value}: {check.reason}"
    return ""


def _first_skip(cell: CellResult) -> str:
    return next((f"{c.name}: {c.reason}" for c in cell.checks if c.verdict is Verdict.SKIP), "")


def classify(old: CellResult | None, new: CellResult | None) -> tuple[str, bool, str]:
    """(change, blocking, reason) of one cell."""
    if new is None:
        return "not run", True, "in the baseline but not run for the candidate"
    failing_new = new.status in FAILING
    reason = _first_problem(new) + (" (silent corruption)" if new.silent_corruption else "")
    if old is None:
        return "new cell", failing_new, reason
    failing_old = old.status in FAILING
    if failing_new and not failing_old:
        return "new FAIL", True, reason
    if failing_new:
        return "still failing", True, reason
    if failing_old:
        return "fixed", False, ""
    if new.status is Verdict.SKIP and old.status is not Verdict.SKIP:
        return "not checked", False, _first_skip(new)
    return ("unchanged" if old.status is new.status else "changed"), False, ""


def _checks(cell: CellResult | None) -> dict[str, CheckResult]:
    return {c.name: c for c in cell.checks} if cell is not None else {}


def metric_deltas(cid: CellId, old: CellResult | None, new: CellResult | None) -> list[MetricDelta]:
    """Per check present on both sides: noise multiples (preferred) or the key metric, old vs new."""
    out = []
    old_checks, new_checks = _checks(old), _checks(new)
    for name, nc in new_checks.items():
        oc = old_checks.get(name)
        if oc is None:
            continue
        om, nm = noise_multiples(oc), noise_multiples(nc)
        shared = [m for m in nm if m in om]
        if shared:
            out += [MetricDelta(cid, name, oc.verdict.value, nc.verdict.value, m, om[m], nm[m], "x noise")
                    for m in shared]
            continue
        ok, nk = key_metric(oc), key_metric(nc)
        if ok is not None or nk is not None:
            metric = (nk or ok)[0]  # type: ignore[index]
            out.append(MetricDelta(cid, name, oc.verdict.value, nc.verdict.value, metric,
                                   ok[1] if ok and ok[0] == metric else None, nk[1] if nk else None, "value"))
    return out


def _num(metrics: dict[str, Any], key: str) -> float | None:
    value = metrics.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def gsm8k_row(cid: CellId, old: CellResult | None, new: CellResult) -> Gsm8kRow | None:
    """The candidate's GSM8K numbers with the baseline build's score, when the cell ran GSM8K."""
    new_checks, old_checks = _checks(new), _checks(old)
    if PAIRED not in new_checks and GATE not in new_checks:
        return None
    paired = new_checks[PAIRED].metrics if PAIRED in new_checks else {}
    gate = new_checks[GATE].metrics if GATE in new_checks else {}
    old_paired = old_checks[PAIRED].metrics if PAIRED in old_checks else {}
    n = _num(paired, "n") or _num(gate, "n")
    score = _num(paired, "par_score")
    mdd = _num(gate, "min_detectable_drop")
    if mdd is None and n and score is not None:  # no stored baseline: the drop this n could detect
        mdd = gate_numbers(int(n), bernoulli_sigma(score), DEFAULT_ALPHA, DEFAULT_BETA)[2]
    verdicts = "/".join(new_checks[k].verdict.value for k in (PAIRED, GATE) if k in new_checks)
    return Gsm8kRow(cell=cid, n=int(n) if n is not None else None, old_score=_num(old_paired, "par_score"),
                    new_score=score, reference_score=_num(paired, "ref_score"),
                    b=int(paired["b"]) if "b" in paired else None, c=int(paired["c"]) if "c" in paired else None,
                    p_value=_num(paired, "p_value"), min_detectable_drop=mdd,
                    verdict=verdicts)


def acceptance_row(cid: CellId, old: CellResult | None, new: CellResult) -> AcceptanceRow | None:
    new_check = _checks(new).get(ACCEPTANCE)
    if new_check is None:
        return None
    old_check = _checks(old).get(ACCEPTANCE)
    return AcceptanceRow(cell=cid, old=_num(old_check.metrics, "mean_accepted_length") if old_check else None,
                         new=_num(new_check.metrics, "mean_accepted_length"),
                         reference=_num(new_check.metrics, "reference_mean_accepted_length"),
                         verdict=new_check.verdict.value)


def unchecked(cid: CellId, old: CellResult | None, new: CellResult | None) -> list[Unchecked]:
    """Checks the candidate skipped, and checks the baseline had that the candidate lacks."""
    if new is None:
        return [Unchecked(cid, "(cell)", "not run for the candidate")]
    out = [Unchecked(cid, c.name, c.reason) for c in new.checks if c.verdict is Verdict.SKIP]
    new_names = {c.name for c in new.checks}
    out += [Unchecked(cid, c.name, "checked in the baseline, absent from the candidate")
            for c in (old.checks if old else ()) if c.name not in new_names and new.status not in FAILING]
    return out


def compare_builds(candidate: Build, baseline: Build) -> Signoff:
    ids = list(candidate.cells) + [c for c in baseline.cells if c not in candidate.cells]
    changes, deltas, gsm8k, acceptance, skipped = [], [], [], [], []
    for cid in ids:
        old, new = baseline.cells.get(cid), candidate.cells.get(cid)
        change, blocking, reason = classify(old, new)
        changes.append(CellChange(cid, old.status if old else None, new.status if new else None,
                                  change, blocking, reason))
        deltas += metric_deltas(cid, old, new)
        skipped += unchecked(cid, old, new)
        if new is not None:
            row = gsm8k_row(cid, old, new)
            if row is not None:
                gsm8k.append(row)
            acc = acceptance_row(cid, old, new)
            if acc is not None:
                acceptance.append(acc)
    return Signoff(candidate, baseline, tuple(changes), tuple(deltas), tuple(gsm8k), tuple(acceptance),
                   tuple(skipped))


PROVENANCE_KEYS = ("git_commit", "engine", "engine_version", "harness_version", "torch_version", "device",
                   "dtypes", "hostname", "python", "suite", "command")


def provenance_rows(build: Build) -> list[tuple[str, str]]:
    """The provenance facts a release manager compares; merged runs list every source's values."""
    prov = build.provenance
    sources = [s.get("provenance", {}) for s in prov.get("sources", []) if isinstance(s, dict)] or [prov]
    rows = [("run", build.run_id), ("folders", ", ".join(str(d) for d in build.dirs))]
    for key in PROVENANCE_KEYS:
        values = []
        for src in sources:
            value = src.get(key)
            text = ", ".join(map(str, value)) if isinstance(value, list) else ("" if value is None else str(value))
            if text and text not in values:
                values.append(text)
        rows.append((key, "; ".join(values) if values else "-"))
    return rows
