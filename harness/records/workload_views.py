"""One run holds every workload of a cell; each workload's checks read a view of it: the same run
directory with only that workload's cases (their indices as the run numbered them)."""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from harness.core.errors import RunError
from harness.records.artifacts import RunArtifacts
from harness.specs.workload import Workload

Views = dict[str, tuple[RunArtifacts, RunArtifacts, RunArtifacts | None, RunArtifacts | None]]


def workload_indices(workloads: Sequence[Workload], run: RunArtifacts) -> dict[str, tuple[int, ...]]:
    """Case indices of each workload: from the run manifest's `workloads` entry, else counted in order
    (each length workload's prompts, the suite's prompts the rest)."""
    entries = run.manifest.get("workloads")
    if isinstance(entries, list) and entries:
        found = {e["name"]: tuple(int(c["index"]) for c in e["cases"]) for e in entries}
        missing = [w.name for w in workloads if w.name not in found]
        if missing:
            raise RunError(f"{run.path}: the manifest's workloads lack {', '.join(missing)}")
        return {w.name: found[w.name] for w in workloads}
    total = len(run.cases)
    own = {w.name: len(w.prompt_lengths()) for w in workloads if not w.suite_prompts}
    rest = total - sum(own.values())
    out, first = {}, 0
    for w in workloads:
        n = own.get(w.name, rest)
        out[w.name] = tuple(c.index for c in run.cases[first:first + n])
        first += n
    return out


def view(run: RunArtifacts, indices: Sequence[int]) -> RunArtifacts:
    """`run` with only the cases of `indices` (tensors and manifest shared, not copied)."""
    keep = set(indices)
    return replace(run, cases=[c for c in run.cases if c.index in keep])


def workload_views(workloads: Sequence[Workload], ref: RunArtifacts, par: RunArtifacts,
                   noise: RunArtifacts | None, noise_ref: RunArtifacts | None = None) -> Views:
    """Per workload: (reference, parallel, noise, the run the noise is measured against where not the reference)
    views over its cases; one workload of runs that hold no other: the runs themselves. `workloads` may be a part of
    the reference's (those a parallel engine ran): each view holds that workload's cases by the reference's indices."""
    entries = ref.manifest.get("workloads")
    if len(workloads) == 1 and not (isinstance(entries, list) and len(entries) > 1):
        return {workloads[0].name: (ref, par, noise, noise_ref)}
    indices = workload_indices(workloads, ref if ref.cases else par)
    return {name: (view(ref, idx), view(par, idx), view(noise, idx) if noise is not None else None,
                   view(noise_ref, idx) if noise_ref is not None else None)
            for name, idx in indices.items()}
