"""self_consistency: one run against itself, without a reference. A workload sends the same prompts
several times under other schedules (harness/specs/workload.py `self-consistency`: first in a batch,
then into the KV slots and recurrent-state pages other sequences freed, in another order, then each
alone), and the engine also generates every case in one plain batch (the twin). A correct engine gives
every copy of a prompt the same greedy tokens, up to near ties of the first copy, and along the common
tokens the same top-1 logprobs up to the dtype's rounding (compare/schedule.py's comparison of two
generations). A state or slot that leaks from one sequence into the next one to use its slot makes the
copies differ, whatever the reference does: the reference runs the same code, so it can carry the bug.

The bounds are floors (SelfConsistencySettings), not scaled by a measured noise: the reference and its
noise run could share the bug, and a noise measured from them would widen as much as the copies move.
"""

from __future__ import annotations

from typing import Any

from harness.artifacts import RunArtifacts
from harness.compare.schedule import GEN, TWIN, Pair, compare_schedules, grade, has_tensors, steps_of
from harness.compare.settings import ScheduleSettings, SelfConsistencySettings
from harness.errors import RunError
from harness.verdict import CheckResult, Verdict

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


def check_self_consistency(run: RunArtifacts, settings: SelfConsistencySettings,
                           extra: dict[str, Any] | None = None) -> CheckResult:
    """The copies of every prompt sent more than once held against the first copy, within floors."""
    if not has_tensors(run, (*GEN, *TWIN)):
        return CheckResult(NAME, Verdict.SKIP, "the run holds no scheduled generations with their one-batch twin")
    groups = copies(run)
    if not groups:
        return CheckResult(NAME, Verdict.SKIP, "the workload sends no prompt twice")
    try:
        pairs = self_pairs(run)
    except RunError as exc:
        return CheckResult(NAME, Verdict.ERROR, str(exc))
    bounds = ScheduleSettings(near_tie=settings.near_tie, logprob_floor=settings.logprob_floor)
    info = {"copies": {str(g[0]): g[1:] for g in groups}, **(extra or {})}
    return grade(NAME, pairs, [], bounds, WHAT, info)
