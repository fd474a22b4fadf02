"""Exactness where an engine promises it. An engine that declares batch invariance and deterministic inference
(Capabilities.batch_invariant: the embedded engine's batch-invariant mode, an engine template's
`batch_invariant: true`) promises that a request's logprobs do not depend on the batch it ran in, nor on the run: the
route checks then hold two generations of one request (as scheduled vs in one plain batch, a copy vs the first
copy) to bitwise equality, tolerance zero, instead of a noise bound. The first difference FAILs naming the request,
its generation step and its token position, and what differs (the token, the top-k ids or a logprob's bits)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from harness.compare.parity.schedule import Steps, steps_of
from harness.core.errors import RunError
from harness.core.verdict import CheckResult, Verdict
from harness.records.artifacts import RunArtifacts

DECLARED = "the engine declares batch invariance (capabilities.batch_invariant): tolerance zero"


@dataclass(frozen=True)
class Twin:
    """Two generations of one prompt that the engine promises equal: `base` (case index, tensor kinds) and
    `other` (case index, tensor kinds); a FAIL names request `other` and `label`, what it is compared with."""

    base: tuple[int, tuple[str, str, str]]
    other: tuple[int, tuple[str, str, str]]
    label: str


@dataclass(frozen=True)
class Difference:
    request: int
    label: str
    step: int
    what: str


def first_difference(base: Steps, other: Steps) -> tuple[int, str] | None:
    """(step, what differs) of the first step whose token, top-k ids or top-k logprobs differ in any bit, or the
    step where one generation ends before the other; None when they are bitwise equal."""
    n = min(len(base.tokens), len(other.tokens), base.lps.shape[0], other.lps.shape[0])
    for step in range(n):
        if base.tokens[step] != other.tokens[step]:
            return step, f"token {other.tokens[step]} vs {base.tokens[step]}"
        if not torch.equal(base.ids[step], other.ids[step]):
            return step, f"top-k ids {other.ids[step].tolist()} vs {base.ids[step].tolist()}"
        a, b = base.lps[step], other.lps[step]
        differ = (a != b) | torch.isnan(a) | torch.isnan(b)  # NaN equals nothing, itself included
        if bool(differ.any()):
            j = int(differ.nonzero()[0, 0])
            x, y = float(b[j]), float(a[j])
            return step, (f"top-{j + 1} logprob {x!r} vs {y!r} (difference {abs(x - y):.1e}, token "
                          f"{int(other.ids[step, j])})")
    if len(base.tokens) != len(other.tokens):
        return n, f"{len(other.tokens)} generated tokens vs {len(base.tokens)}"
    return None


def differences(run: RunArtifacts, twins: Sequence[Twin]) -> tuple[list[Difference], int]:
    """Every twin's first difference, and the steps compared."""
    found, steps = [], 0
    for twin in twins:
        base, other = steps_of(run, *twin.base), steps_of(run, *twin.other)
        steps += min(len(base.tokens), len(other.tokens))
        diff = first_difference(base, other)
        if diff is not None:
            found.append(Difference(twin.other[0], twin.label, *diff))
    return found, steps


def check_exact(name: str, run: RunArtifacts, twins: Sequence[Twin], what: str,
                extra: dict[str, Any] | None = None) -> CheckResult:
    """`name` held to bitwise equality of every twin (the module docstring)."""
    try:
        found, steps = differences(run, twins)
    except RunError as exc:
        return CheckResult(name, Verdict.ERROR, str(exc))
    metrics: dict[str, Any] = {"exact": True, "pairs": len(twins), "steps_compared": steps,
                               "differing_pairs": len(found), **(extra or {})}
    if found:
        d = found[0]
        case = next((c for c in run.cases if c.index == d.request), None)
        position = f" (token position {len(case.prompt_ids) + d.step})" if case is not None else ""
        metrics["first_difference"] = {"request": d.request, "against": d.label, "step": d.step, "what": d.what}
        return CheckResult(name, Verdict.FAIL, f"request {d.request} differs from {d.label} at generation step "
                           f"{d.step}{position}: {d.what}; {len(found)}/{len(twins)} pairs differ ({what}); "
                           f"{DECLARED}", metrics)
    return CheckResult(name, Verdict.PASS, f"{len(twins)} pairs, {steps} steps {what}: bitwise equal; {DECLARED}",
                       metrics)
