"""acceptance_per_position: the acceptance rate of each draft position as a gated metric.

A drafter bug often leaves the mean acceptance near its floor while one position collapses (TensorRT-LLM
#16617: an MTP under TP with batch > 1 whose later positions fell from 0.95 to 0.05 acceptance). Each
verify step drafts positions 1..k and accepts a prefix of them, so position p's rate is the fraction of
verify steps that accepted p or more drafts (harness/core/acceptance.py: accepted_per_position).

Measured: from the run's per-step traces (spec_accepted.{i}: the embedded engine), else from the
engine's per-position counters (vLLM's vllm:spec_decode_num_accepted_tokens_per_pos with
vllm:spec_decode_num_drafts, recorded as the manifest's speculative.histogram), else a SKIP naming them.
Expected, per position: the stored acceptance baseline's histogram (baselines/acceptance.yaml, the key of
harness/baselines/acceptance_baseline.py), or, where the key has no baseline with a histogram, TensorRT-LLM's floor:
reference_floor (0.95) x the reference run's rate at that position.
Gate: GSM8K's one-sided test (harness/gsm8k/stats.py baseline_gate): a position FAILs when its rate falls
below expected + z(alpha) x sqrt(2 sigma^2 / steps), sigma the Bernoulli sigma of the measured rate; a
position the test has no power for (threshold <= 0) is not gated. The check is performance-only: a FAIL
names the first failing position.
"""

from __future__ import annotations

from typing import Any, Sequence

from harness.baselines.acceptance_baseline import key_of_run, load_acceptance
from harness.checks.context import CellContext
from harness.compare.settings import AcceptanceSettings
from harness.compare.speculative import has_traces, speculative_manifest
from harness.core.acceptance import accepted_per_position, histogram
from harness.core.errors import RunError
from harness.core.verdict import CheckResult, Verdict
from harness.gsm8k.stats import baseline_gate
from harness.records.artifacts import RunArtifacts
from harness.records.contract import SPEC_ACCEPTED

NAME = "acceptance_per_position"
PER_POSITION_COUNTER = "vllm:spec_decode_num_accepted_tokens_per_pos"


def measured_histogram(run: RunArtifacts, k: int) -> list[int] | None:
    """Verify steps per accepted count 0..k: from the per-step traces, else the histogram the engine's
    per-position counters gave (manifest speculative.histogram); None when the run has neither."""
    if has_traces(run):
        return histogram([[int(a) for a in run.tensor(SPEC_ACCEPTED, c.index).tolist()] for c in run.cases], k)
    hist = (speculative_manifest(run) or {}).get("histogram")
    if hist is None:
        return None
    if not isinstance(hist, list) or len(hist) != k + 1 or not all(isinstance(n, int) and n >= 0 for n in hist):
        raise RunError(f"{run.path}: speculative.histogram {hist!r} is not {k + 1} counts (accepted 0..{k})")
    return hist


def rates(hist: Sequence[int]) -> list[float]:
    """Acceptance rate of draft positions 1..k (NaN-free: 0 steps give rate 0)."""
    steps = sum(hist)
    return [n / steps if steps else 0.0 for n in accepted_per_position(hist)]


def gate_positions(measured: Sequence[int], expected: Sequence[float], source: str,
                   settings: AcceptanceSettings) -> CheckResult:
    """Each position's measured rate (from histogram `measured`) against `expected` by the one-sided test."""
    steps = sum(measured)
    got = rates(measured)
    rows: list[dict[str, Any]] = []
    for p, (rate, want) in enumerate(zip(got, expected), start=1):
        outcome = baseline_gate(min(1.0, max(0.0, want)), rate, steps, alpha=settings.position_alpha)
        rows.append({"position": p, "rate": rate, "expected": want, "threshold": outcome.threshold,
                     "verdict": outcome.verdict.value})
    metrics: dict[str, Any] = {"steps": steps, "source": source, "positions": rows, "histogram": list(measured),
                               "alpha": settings.position_alpha}
    failed = [r for r in rows if r["verdict"] == Verdict.FAIL.value]
    gated = [r for r in rows if r["verdict"] != Verdict.SKIP.value]
    table = ", ".join(f"{r['position']}: {r['rate']:.3f}" for r in rows)
    if failed:
        r = failed[0]
        rest = [str(f["position"]) for f in failed[1:]]
        others = f" (and position{'s' if len(rest) > 1 else ''} {', '.join(rest)})" if rest else ""
        return CheckResult(NAME, Verdict.FAIL, f"draft position {r['position']}: acceptance {r['rate']:.3f} < "
                           f"threshold {r['threshold']:.3f} (expected {r['expected']:.3f} from {source}, "
                           f"{steps} verify steps, alpha={settings.position_alpha}){others}; per position {table}",
                           metrics)
    if not gated:
        return CheckResult(NAME, Verdict.SKIP, f"{steps} verify steps give the test no power at any position "
                           f"(expected rates from {source}); per position {table}", metrics)
    return CheckResult(NAME, Verdict.PASS, f"every draft position at or above its threshold (expected from "
                       f"{source}, {steps} verify steps); per position {table}", metrics)


def acceptance_per_position(ctx: CellContext) -> list[CheckResult]:
    """The check (module docstring): against the stored baseline's histogram, else the reference's floor."""
    settings = ctx.settings.of(AcceptanceSettings)
    spec = speculative_manifest(ctx.par)
    if spec is None or "k" not in spec:
        return [CheckResult(NAME, Verdict.ERROR, "the parallel run has no speculative decoding results")]
    k = int(spec["k"])
    if spec.get("histogram_error"):  # the engine's per-position counters were not a prefix acceptance
        return [CheckResult(NAME, Verdict.ERROR, f"engine {ctx.info.engine}'s per-position counters: "
                            f"{spec['histogram_error']}")]
    measured = measured_histogram(ctx.par, k)
    if measured is None:
        return [CheckResult(NAME, Verdict.SKIP, f"engine {ctx.info.engine} recorded no per-step accept traces "
                            f"(spec_accepted) and exports no per-position counters ({PER_POSITION_COUNTER})")]
    if not sum(measured):
        return [CheckResult(NAME, Verdict.SKIP, "no verify steps (max_new_tokens too small?)")]
    try:
        entry = load_acceptance(ctx.info.baselines_dir).get(key_of_run(ctx.par, ctx.info.model, ctx.info.engine))
    except RunError:
        entry = None
    if entry is not None and entry.histogram is not None:
        expected = rates(entry.histogram)
        return [gate_positions(measured, expected, f"the stored baseline ({sum(entry.histogram)} steps)", settings)]
    ref_hist = measured_histogram(ctx.ref, k) if speculative_manifest(ctx.ref) is not None else None
    if ref_hist is None or not sum(ref_hist):
        return [CheckResult(NAME, Verdict.SKIP, "no acceptance baseline with a histogram for this key and no "
                            f"per-position acceptance of the reference run (engine {ctx.info.reference_engine})")]
    floor = settings.reference_floor
    expected = [floor * r for r in rates(ref_hist)]
    return [gate_positions(measured, expected, f"{floor:g} x the reference run's rate (no stored baseline)",
                           settings)]
