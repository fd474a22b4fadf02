"""Sign-off: a candidate build's cells against the last signed-off build's (pure functions of results).

A cell is what results.json and the report identify it by (report.merge.cell_key: suite, model, topology,
fault, seed, workload), and every cell of the candidate is compared. An injected fault stands for a faulty
build, so a candidate cell with a fault the baseline did not run is compared with the baseline's same cell
without it (and a clean candidate cell with the baseline's one faulted variant). Candidate and baseline
must cover the same cells: a cell on one side only is refused (exit 2, naming the cells), never a
silent gap. The candidate is BLOCKED when any of its cells FAILs, ERRORs or was not run (its run
stopped first); otherwise it can be signed off. Skipped checks are listed, never silently green.

Each blocking cell is in one category (CATEGORIES), by the candidate cell's failure class:
new output corruption (a FAIL of an output or layout check, silent or not), new performance-only
regression (only performance checks FAIL), new ERROR (the run could not complete: PASS->ERROR and
FAIL->ERROR are this, never a new FAIL), still failing (the same failure class as in the baseline),
not run (a cell the candidate's run never reached: interrupted or out of disk). A candidate that is
the same run as its baseline is refused (same_run).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from harness.core.checkmetrics import key_metric, noise_multiples
from harness.core.errors import ConfigError
from harness.core.verdict import CellResult, CheckResult, FailureClass, Verdict
from harness.gsm8k.stats import DEFAULT_ALPHA, DEFAULT_BETA, bernoulli_sigma, gate_numbers
from harness.report.merge import CellKey, cell_key, key_label, merge

CellId = CellKey
FAILING = (Verdict.FAIL, Verdict.ERROR)
PAIRED, GATE, ACCEPTANCE = "gsm8k_paired", "gsm8k_baseline", "acceptance"
REFERENCE = "reference_baseline"  # the cell's reference against its recording (harness/baselines/reference_baseline.py)
NEW_OUTPUT, NEW_PERFORMANCE, NEW_ERROR = "new output corruption", "new performance-only", "new ERROR"
STILL_FAILING, NOT_RUN = "still failing", "not run"
# the blocking categories, in the order the page and signoff.json count them: (change, signoff.json key)
CATEGORIES: tuple[tuple[str, str], ...] = (
    (NEW_OUTPUT, "new_output_corruption"), (NEW_PERFORMANCE, "new_performance_only"), (NEW_ERROR, "new_error"),
    (STILL_FAILING, "still_failing"), (NOT_RUN, "not_run"))
NEW_BY_CLASS = {FailureClass.OUTPUT: NEW_OUTPUT, FailureClass.PERFORMANCE: NEW_PERFORMANCE,
                FailureClass.INFRASTRUCTURE: NEW_ERROR}


@dataclass(frozen=True)
class Build:
    """One side of the comparison: its cells by id and its provenance. `runs`: per source run its
    (run id, git commit, command); `digest`: its cells as canonical JSON (what same_run compares)."""

    dirs: tuple[Path, ...]
    cells: dict[CellId, CellResult]
    provenance: dict[str, Any]
    run_id: str
    runs: tuple[tuple[str, str, str], ...] = ()
    digest: str = ""


@dataclass(frozen=True)
class CellChange:
    cell: CellId
    old: Verdict | None
    new: Verdict | None
    change: str  # a blocking category (CATEGORIES) | fixed | unchanged | changed | not checked | new cell
    blocking: bool
    reason: str          # the candidate's first failing check, or why it blocks
    failure_class: FailureClass | None = None  # the candidate cell's
    silent: bool = False  # the candidate cell is silent corruption (output corruption, clean exit)

    @property
    def label(self) -> str:
        return key_label(self.cell)


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
class ReferenceRow:
    """A candidate cell whose reference changed since its recording (FAIL), or whose recording carries an accepted
    numerics change (an intended change, with its reason)."""

    cell: CellId
    verdict: str
    recorded_by: str
    accepted: str   # "" or "DATE: REASON (replaced build COMMIT)"
    reason: str


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
    references: tuple[ReferenceRow, ...] = ()

    @property
    def blocking(self) -> tuple[CellChange, ...]:
        return tuple(c for c in self.changes if c.blocking)

    @property
    def signed_off(self) -> bool:
        return not self.blocking

    def counts(self) -> dict[str, int]:
        """Blocking cells per category (signoff.json keys), the silent ones among the new output
        corruptions, and the totals."""
        out = {key: sum(1 for c in self.blocking if c.change == change) for change, key in CATEGORIES}
        out["new_silent_corruption"] = sum(1 for c in self.blocking if c.change == NEW_OUTPUT and c.silent)
        out.update(blocking=len(self.blocking), cells=len(self.changes))
        return out


def load_build(dirs: Sequence[Path], side: str) -> Build:
    """The cells of one build's run folders (merged like `harness report A B`)."""
    if not dirs:
        raise ConfigError(f"--{side} needs at least one run folder")
    cells, provenance, run_id = merge(list(dirs))
    by_id = {cell_key(cell): cell for cell in cells}  # merge keeps one cell per key
    sources = [(str(s.get("run_id", "")), s.get("provenance") or {}) for s in provenance.get("sources", [])
               if isinstance(s, dict)] or [(run_id, provenance)]
    runs = tuple(sorted((rid, str(p.get("git_commit", "")), str(p.get("command", ""))) for rid, p in sources))
    digest = json.dumps(sorted((c.to_dict() for c in cells), key=lambda d: json.dumps(d, sort_keys=True)),
                        sort_keys=True)
    return Build(tuple(dirs), by_id, provenance, run_id, runs, digest)


def same_run(candidate: Build, baseline: Build) -> str:
    """Why the two sides are the same results ('' when they are not): the same runs (run id, git commit
    and command of every source) or identical cells (a copied or re-rendered results.json)."""
    if candidate.runs == baseline.runs:
        rid = ", ".join(r[0] for r in candidate.runs)
        return f"the candidate is the same run as the baseline (run {rid}, same git commit and command)"
    if candidate.digest == baseline.digest:
        return "the candidate's results are identical to the baseline's (the same run's results.json)"
    return ""


def _without_fault(key: CellId) -> CellId:
    suite, model, topology, _, seed, workload = key
    return (suite, model, topology, None, seed, workload)


def counterpart(key: CellId, baseline: dict[CellId, CellResult]) -> CellId | None:
    """The baseline cell a candidate cell is compared with: the same cell; else, the fault standing for a
    faulty build, the same cell without a fault, or the baseline's one faulted variant of it; else None."""
    if key in baseline:
        return key
    plain = _without_fault(key)
    if plain in baseline:
        return plain
    variants = [k for k in baseline if _without_fault(k) == plain]
    return variants[0] if len(variants) == 1 else None


def _listed(keys: Sequence[CellId], limit: int = 6) -> str:
    more = f" (+{len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(key_label(k) for k in keys[:limit]) + more


def coverage_problem(candidate: Build, baseline: Build) -> str:
    """Why the two builds cannot be compared cell by cell ('' when every cell of each has its counterpart)."""
    pairs = {k: counterpart(k, baseline.cells) for k in candidate.cells}
    extra = [k for k, p in pairs.items() if p is None]
    paired = set(pairs.values())
    missing = [k for k in baseline.cells if k not in paired]
    if not extra and not missing:
        return ""
    parts = ([f"{len(missing)} cell(s) of the baseline not run for the candidate: {_listed(missing)}"] if missing
             else []) + ([f"{len(extra)} cell(s) of the candidate the baseline did not run: {_listed(extra)}"]
                         if extra else [])
    return (f"candidate and baseline do not cover the same cells: {'; '.join(parts)}; sign off runs of the same "
            f"matrix (suites, models, topologies, seeds, workloads)")


def _first_problem(cell: CellResult) -> str:
    for check in cell.checks:
        if check.verdict in FAILING:
            return f"{check.name} {check.verdict.value}: {check.reason}"
    return ""


def _first_skip(cell: CellResult) -> str:
    return next((f"{c.name}: {c.reason}" for c in cell.checks if c.verdict is Verdict.SKIP), "")


def classify(old: CellResult | None, new: CellResult) -> tuple[str, bool, str]:
    """(change, blocking, reason) of one cell. A failing candidate cell is in the category of its failure
    class (new output corruption, new performance-only, new ERROR) unless the baseline cell failed
    with the same class (still failing); a candidate cell its run never reached is not run."""
    if new.not_run:
        return NOT_RUN, True, f"not run for the candidate: {new.checks[0].reason}"
    reason = _first_problem(new) + (" (silent corruption)" if new.silent_corruption else "")
    if new.status in FAILING:
        assert new.failure_class is not None
        if old is None:
            return NEW_BY_CLASS[new.failure_class], True, reason + " (a cell the baseline did not run)"
        if old.status in FAILING and old.failure_class is new.failure_class:
            return STILL_FAILING, True, f"{new.failure_class.label}: {reason}"
        return NEW_BY_CLASS[new.failure_class], True, reason
    if old is None:
        return "new cell", False, ""
    if old.status in FAILING:
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


def reference_row(cid: CellId, new: CellResult) -> ReferenceRow | None:
    """The candidate cell's recorded-reference row: where its reference changed, or its recording was accepted."""
    check = _checks(new).get(REFERENCE)
    if check is None:
        return None
    accepted = check.metrics.get("accepted_change")
    if check.verdict is not Verdict.FAIL and not accepted:
        return None
    text = ""
    if isinstance(accepted, dict):
        replaced = accepted.get("replaced") or {}
        text = (f"{accepted.get('date')}: {accepted.get('reason')} (replaced the recording of build "
                f"{str(replaced.get('git_commit') or '?')[:12]})")
    return ReferenceRow(cid, check.verdict.value, str(check.metrics.get("recorded_by", "")), text, check.reason)


def unchecked(cid: CellId, old: CellResult | None, new: CellResult) -> list[Unchecked]:
    """Checks the candidate skipped, and checks the baseline had that the candidate lacks."""
    if new.not_run:
        return [Unchecked(cid, "(cell)", "not run for the candidate")]
    out = [Unchecked(cid, c.name, c.reason) for c in new.checks if c.verdict is Verdict.SKIP]
    new_names = {c.name for c in new.checks}
    out += [Unchecked(cid, c.name, "checked in the baseline, absent from the candidate")
            for c in (old.checks if old else ()) if c.name not in new_names and new.status not in FAILING]
    return out


def compare_builds(candidate: Build, baseline: Build) -> Signoff:
    """Every candidate cell against its baseline counterpart; ConfigError when the two cover other cells."""
    why = coverage_problem(candidate, baseline)
    if why:
        raise ConfigError(why)
    changes, deltas, gsm8k, acceptance, skipped, references = [], [], [], [], [], []
    for cid, new in candidate.cells.items():
        base = counterpart(cid, baseline.cells)
        old = baseline.cells[base] if base is not None else None
        if old is not None and old.not_run:  # the baseline's run never reached it: no verdict to compare with
            old = None
        change, blocking, reason = classify(old, new)
        changes.append(CellChange(cid, old.status if old else None, new.status, change, blocking, reason,
                                  new.failure_class, new.silent_corruption))
        deltas += metric_deltas(cid, old, new)
        skipped += unchecked(cid, old, new)
        row = gsm8k_row(cid, old, new)
        if row is not None:
            gsm8k.append(row)
        acc = acceptance_row(cid, old, new)
        if acc is not None:
            acceptance.append(acc)
        ref = reference_row(cid, new)
        if ref is not None:
            references.append(ref)
    return Signoff(candidate, baseline, tuple(changes), tuple(sort_deltas(deltas)), tuple(gsm8k),
                   tuple(acceptance), tuple(skipped), tuple(references))


def delta_changed(d: MetricDelta) -> bool:
    """The verdict or the number moved (a metric on one side only counts as moved)."""
    return d.old_verdict != d.new_verdict or d.old != d.new


def _delta_size(d: MetricDelta) -> float:
    """How far it moved: noise multiples by their difference, other numbers relative to the baseline's."""
    if d.old is None or d.new is None:
        return float("inf")
    diff = abs(d.new - d.old)
    return diff if d.unit == "x noise" else (diff / abs(d.old) if d.old else (float("inf") if diff else 0.0))


def sort_deltas(deltas: Sequence[MetricDelta]) -> list[MetricDelta]:
    """Changes first: verdict changes, then the largest moves (noise multiples before other numbers);
    unchanged metrics last, in their order."""
    changed = sorted((d for d in deltas if delta_changed(d)),
                     key=lambda d: (d.old_verdict == d.new_verdict, d.unit != "x noise", -_delta_size(d)))
    return changed + [d for d in deltas if not delta_changed(d)]


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
