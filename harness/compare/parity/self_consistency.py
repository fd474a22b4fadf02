"""self_consistency: one run against itself, without a reference. A workload sends the same prompts
several times under other schedules (harness/specs/workload.py `self-consistency`: first in a batch,
then into the KV slots and recurrent-state pages other sequences freed, in another order, then each
alone), and the engine also generates every case in one plain batch (the twin). A correct engine gives
every copy of a prompt the same greedy tokens, up to near ties of the first copy, and along the common
tokens the same top-1 logprobs up to rounding (compare/parity/schedule.py's comparison of two
generations). A state or slot that leaks from one sequence into the next one to use its slot makes the
copies differ, whatever the reference does: the reference runs the same code, so it can carry the bug.

A copy that jumps (diverges outside the near ties) FAILs unless the reference engine's rounding-only
comparisons jump as often (compare/parity/jumps.py).

Bounds: max(floor, factor x noise) (SelfConsistencySettings), where the noise is how far the reference's
generations of the same cases differ from its noise run's (both as scheduled): the same engine under
another reduction order, so rounding only, even where both carry the bug (a fault in code the reference
runs too is injected into both, runner.references). The reference's own copies are never the noise: a
bug it shares would widen the bound as much as it moves the copies.
"""

from __future__ import annotations

from typing import Any

from harness.compare.parity.jumps import JumpEvidence
from harness.compare.parity.schedule import (
    GEN,
    TWIN,
    Pair,
    compare_schedules,
    engine_evidence,
    grade,
    has_tensors,
    steps_of,
)
from harness.compare.parity.step_rounding import step_rounding
from harness.compare.settings import SelfConsistencySettings
from harness.core.errors import RunError
from harness.core.verdict import CheckResult, Verdict
from harness.records.artifacts import RunArtifacts

NAME = "self_consistency"
WHAT = "copies against its first copy"


def copies(run: RunArtifacts) -> list[list[int]]:
    """Case indices of the run's prompts sent more than once, grouped by prompt token ids, in send order."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for case in run.cases:
        groups.setdefault(tuple(case.prompt_ids), []).append(case.index)
    return [group for group in groups.values() if len(group) > 1]


def self_pairs(run: RunArtifacts) -> list[Pair]:
    """Every later copy of each prompt (and the first copy's one-batch twin) against its first copy."""
    pairs = []
    for group in copies(run):
        first = steps_of(run, group[0], GEN)
        pairs += [compare_schedules(i, first, steps_of(run, i, GEN)) for i in group[1:]]
        pairs.append(compare_schedules(group[0], first, steps_of(run, group[0], TWIN)))
    return pairs


def noise_pairs(ref: RunArtifacts | None, noise: RunArtifacts | None) -> list[list[Pair]]:
    """The reference's generation of every case against its noise run's (rounding only), or none."""
    if ref is None or noise is None or not has_tensors(ref, GEN) or not has_tensors(noise, GEN):
        return []
    return [[compare_schedules(c.index, steps_of(ref, c.index, GEN), steps_of(noise, c.index, GEN))
             for c in ref.cases]]


def check_self_consistency(run: RunArtifacts, ref: RunArtifacts | None, noise: RunArtifacts | None,
                           settings: SelfConsistencySettings, extra: dict[str, Any] | None = None,
                           evidence: JumpEvidence | None = None) -> CheckResult:
    """The copies of every prompt sent more than once held against the first copy, within the noise; `evidence`:
    the engine's jumps under rounding over more cases than these (None: engine_evidence of `ref` and `noise`)."""
    if not has_tensors(run, (*GEN, *TWIN)):
        return CheckResult(NAME, Verdict.SKIP, "the run holds no scheduled generations with their one-batch twin")
    groups = copies(run)
    if not groups:
        return CheckResult(NAME, Verdict.SKIP, "the workload sends no prompt twice")
    try:
        pairs = self_pairs(run)
        measured = noise_pairs(ref, noise)
        if evidence is None and ref is not None:
            evidence = engine_evidence(ref, noise)
    except RunError as exc:
        return CheckResult(NAME, Verdict.ERROR, str(exc))
    info = {"copies": {str(g[0]): g[1:] for g in groups}, **(extra or {})}
    return grade(NAME, pairs, measured, settings, WHAT, info, evidence, step_rounding(ref))
