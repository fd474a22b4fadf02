"""Stored acceptance baselines of speculative decoding, and the gate of a cell against them.

The reference comparison of the `acceptance` check is blind to a bug in code the tp1 reference runs
too (the verify step, the accept bookkeeping): both runs change alike. A stored baseline is not.
Like TensorRT-LLM's references/acceptance_length.yaml, parallelism is not part of the key: every
topology of a model must reproduce the same acceptance.

File baselines/acceptance.yaml (schema ACCEPTANCE_SCHEMA_VERSION):

    schema_version: 1
    baselines:
    - model: tiny-gqa              # identity (AcceptanceKey): model, engine, speculator kind, k,
      engine: embedded             #   the other speculator settings, dtype, the target's weights
      speculator: mtp              #   (weights_hash), the prompts' token ids (prompts_hash), max_new_tokens
      k: 3
      settings: {draft_noise: 0.1, mtp_hidden_mix: 0.1}
      dtype: float32
      weights_hash: 11a8a1a78efc...
      prompts_hash: 930ec89c37eb...
      max_new_tokens: 24
      mean_accepted_length: 1.9079  # tokens committed per verify step (accepted drafts + 1)
      histogram: [42, 12, 9, 13]    # verify steps per accepted count 0..k (null from engine counters)
      provenance: {harness_version, git_commit, device, date, run_id, suite, topology, command}

Written only by `harness baseline update --from RUN_DIR` (from the cells' reference measurements),
which shows the diff first. The file is read, diffed and written by the one baseline store, under its
provenance rule (harness/baselines/baseline_store.py). The tolerances are AcceptanceSettings' baseline_* fields.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from harness.baselines.baseline_store import (
    BaselineSet,
    measured_by,
    provenance_of,
    read_entries,
    unrecordable,
    write_file,
)
from harness.compare.settings import AcceptanceSettings
from harness.core.acceptance import total_variation
from harness.core.errors import ConfigError, RunError
from harness.core.paths import BASELINES_DIR
from harness.core.verdict import CellResult, CheckResult, Verdict
from harness.records.contract import JOB_FILE, MANIFEST_PROMPTS_HASH, MANIFEST_WEIGHTS_HASH, Job
from harness.specs.loader import check_keys, expect_int
from harness.specs.speculative import SpeculativeSettings

if TYPE_CHECKING:  # torch only where runs are read: `harness report` / `plan` / `baseline` stay light
    from harness.records.artifacts import RunArtifacts

ACCEPTANCE_SCHEMA_VERSION = 1
ACCEPTANCE_FILE = "acceptance.yaml"
BASELINE_CHECK = "acceptance_baseline"
_KEY_FIELDS: tuple[str, ...] = ("model", "engine", "speculator", "k", "settings", "dtype", "weights_hash",
                                "prompts_hash", "max_new_tokens")
_ENTRY_KEYS: tuple[str, ...] = (*_KEY_FIELDS, "mean_accepted_length", "histogram", "provenance")


@dataclass(frozen=True)
class AcceptanceKey:
    """What an acceptance measurement depends on (never the topology: acceptance must not change with it)."""

    model: str
    engine: str
    speculator: str
    k: int
    settings: tuple[tuple[str, Any], ...]  # the speculator's other settings (draft_noise, ...), sorted
    dtype: str
    weights_hash: str  # the target's weights (a run seed reseeds synthetic weights: another model)
    prompts_hash: str
    max_new_tokens: int

    @property
    def label(self) -> str:
        extra = ", ".join(f"{n}={v}" for n, v in self.settings)
        return (f"{self.model} / {self.engine} / {self.speculator} k={self.k}{' (' + extra + ')' if extra else ''} / "
                f"{self.dtype} / weights {self.weights_hash[:12]} / prompts {self.prompts_hash[:12]} / "
                f"{self.max_new_tokens} new tokens")

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "engine": self.engine, "speculator": self.speculator, "k": self.k,
                "settings": dict(self.settings), "dtype": self.dtype, "weights_hash": self.weights_hash,
                "prompts_hash": self.prompts_hash,
                "max_new_tokens": self.max_new_tokens}

    @classmethod
    def from_dict(cls, where: str, data: Mapping[str, Any]) -> "AcceptanceKey":
        settings = data.get("settings") or {}
        if not isinstance(settings, Mapping):
            raise ConfigError(f"{where}: settings must be a mapping, got {settings!r}")
        k = expect_int(where, "k", data["k"], minimum=1)
        return cls(model=str(data["model"]), engine=str(data["engine"]), speculator=str(data["speculator"]),
                   k=k, settings=other_settings(SpeculativeSettings.from_mapping({**settings, "k": k},
                                                                                 f"{where}: settings")),
                   dtype=str(data["dtype"]), weights_hash=str(data["weights_hash"]),
                   prompts_hash=str(data["prompts_hash"]),
                   max_new_tokens=expect_int(where, "max_new_tokens", data["max_new_tokens"], minimum=1))


@dataclass(frozen=True)
class AcceptanceBaseline:
    """The expected acceptance of one key, with how it was measured."""

    key: AcceptanceKey
    mean_accepted_length: float
    histogram: tuple[int, ...] | None = None
    provenance: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        mean = self.mean_accepted_length
        if isinstance(mean, bool) or not isinstance(mean, (int, float)) or not 1.0 <= mean <= self.key.k + 1:
            raise ConfigError(f"acceptance baseline {self.key.label}: mean_accepted_length={mean!r} must be a "
                              f"number in 1..{self.key.k + 1}")
        if self.histogram is not None and (len(self.histogram) != self.key.k + 1
                                           or any(isinstance(n, bool) or not isinstance(n, int) or n < 0
                                                  for n in self.histogram)):
            raise ConfigError(f"acceptance baseline {self.key.label}: histogram {list(self.histogram)!r} must be "
                              f"{self.key.k + 1} non-negative integers (steps per accepted count 0..{self.key.k})")

    @property
    def label(self) -> str:
        return self.key.label

    @property
    def sort_key(self) -> str:
        return self.key.label

    def summary(self) -> str:
        hist = list(self.histogram) if self.histogram is not None else None
        return f"mean accepted length {self.mean_accepted_length:.4f}, histogram {hist}"

    def to_dict(self) -> dict[str, Any]:
        return {**self.key.to_dict(), "mean_accepted_length": float(self.mean_accepted_length),
                "histogram": list(self.histogram) if self.histogram is not None else None,
                "provenance": dict(self.provenance)}


@dataclass(frozen=True)
class AcceptanceBaselines(BaselineSet[AcceptanceBaseline]):
    """All acceptance baselines (one file for every suite)."""

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": ACCEPTANCE_SCHEMA_VERSION, "baselines": [e.to_dict() for e in self.entries]}


def acceptance_path(folder: Path = BASELINES_DIR) -> Path:
    return folder / ACCEPTANCE_FILE


def _entry(where: str, data: Any) -> AcceptanceBaseline:
    check_keys(where, data, _ENTRY_KEYS,
               required=(*(f for f in _KEY_FIELDS if f != "settings"), "mean_accepted_length"))
    hist = data.get("histogram")
    if hist is not None and not isinstance(hist, list):
        raise ConfigError(f"{where}: histogram must be a list or null, got {hist!r}")
    return AcceptanceBaseline(AcceptanceKey.from_dict(where, data), data["mean_accepted_length"],
                              tuple(hist) if hist is not None else None, provenance_of(where, data))


def read_acceptance(path: Path) -> AcceptanceBaselines:
    """Parse an acceptance baselines file; a missing file holds none."""
    if not path.is_file():
        return AcceptanceBaselines()
    _, entries = read_entries(path, ("schema_version", "baselines"), ACCEPTANCE_SCHEMA_VERSION,
                              "acceptance baselines", _entry)
    return AcceptanceBaselines(tuple(entries))


def load_acceptance(folder: Path = BASELINES_DIR) -> AcceptanceBaselines:
    return read_acceptance(acceptance_path(folder))


def write_acceptance(baselines: AcceptanceBaselines, path: Path) -> None:
    """Write atomically (a crash never leaves half a file)."""
    write_file(path, "# Speculative-decoding acceptance baselines; written by `harness baseline update --from "
               "RUN_DIR`\n# (edit with care). Tolerances: AcceptanceSettings.baseline_* "
               "(harness/compare/settings.py).\n", baselines.to_dict())


def other_settings(settings: SpeculativeSettings) -> tuple[tuple[str, Any], ...]:
    """The key's settings: every speculator setting but k (its own key field), sorted, defaults included
    (a stored key that names fewer reads with the defaults filled in)."""
    return tuple(sorted((name, value) for name, value in settings.to_dict().items() if name != "k"))


def key_of_run(run: RunArtifacts, model: str, engine: str) -> AcceptanceKey:
    """The baseline key of a -draft / -mtp run directory (its manifest and job.json)."""
    spec = run.manifest.get("speculative")
    if not isinstance(spec, Mapping) or "kind" not in spec or "k" not in spec:
        raise RunError(f"{run.path}: manifest has no speculative kind and k")
    job_path = run.path / JOB_FILE
    if not job_path.is_file():
        raise RunError(f"{run.path}: no {JOB_FILE} (the speculator settings and max_new_tokens)")
    try:
        job = Job.load(job_path)
    except ConfigError as exc:
        raise RunError(f"{job_path}: {exc}") from exc
    return AcceptanceKey(model=model, engine=engine, speculator=str(spec["kind"]), k=int(spec["k"]),
                         settings=other_settings(job.speculative or SpeculativeSettings()),
                         dtype=str(run.manifest.get("dtype")),
                         weights_hash=str(run.manifest.get(MANIFEST_WEIGHTS_HASH)),
                         prompts_hash=str(run.manifest.get(MANIFEST_PROMPTS_HASH)),
                         max_new_tokens=job.max_new_tokens)


def gate_acceptance(baselines: AcceptanceBaselines, key: AcceptanceKey, mean: float, hist: list[int] | None,
                    settings: AcceptanceSettings, update_command: str) -> CheckResult:
    """A cell's mean accepted length (and histogram) against the stored baseline of its key: FAIL when
    they differ by more than settings.baseline_tolerance (either way: a verify or bookkeeping bug may
    inflate acceptance too), WARN when the histograms' total-variation distance exceeds tv_warn;
    SKIP naming the command that records one when the key has no baseline."""
    entry = baselines.get(key)
    metrics: dict[str, Any] = {"key": key.to_dict(), "measured": mean, "mean_accepted_length": mean,
                               "update_command": update_command}
    if entry is None:
        return CheckResult(BASELINE_CHECK, Verdict.SKIP,
                           f"no acceptance baseline for {key.label}; record one from a clean run with "
                           f"`{update_command}`", metrics)
    if math.isnan(mean):
        return CheckResult(BASELINE_CHECK, Verdict.SKIP, "no verify steps to compare with the baseline", metrics)
    base = float(entry.mean_accepted_length)
    tol = settings.baseline_tolerance(base)
    diff = mean - base

    tv = total_variation(list(entry.histogram), hist) if entry.histogram is not None and hist is not None else None
    metrics.update({"baseline": base, "difference": diff, "tolerance": tol, "baseline_histogram":
                    list(entry.histogram) if entry.histogram is not None else None, "histogram": hist,
                    "total_variation": tv, "baseline_provenance": dict(entry.provenance)})
    means = f"mean accepted length {mean:.3f} vs stored baseline {base:.3f}"
    if abs(diff) > tol:
        way = "below" if diff < 0 else "above"
        return CheckResult(BASELINE_CHECK, Verdict.FAIL,
                           f"{means}: {abs(diff):.3f} {way} it, > tolerance {tol:.3f} "
                           f"(max({settings.baseline_abs_tol:g}, "
                           f"{settings.baseline_rel_tol:g} x baseline)); the reference changed alike if the "
                           f"acceptance check passes: suspect code both run (verify, accept bookkeeping)", metrics)
    if tv is not None and tv > settings.tv_warn:
        return CheckResult(BASELINE_CHECK, Verdict.WARN, f"{means}; histogram total-variation distance to the "
                           f"baseline {tv:.3f} > {settings.tv_warn:g}", metrics)
    return CheckResult(BASELINE_CHECK, Verdict.PASS, f"{means} (tolerance {tol:.3f})", metrics)


def baseline_check(par: RunArtifacts, acceptance: CheckResult, model: str, engine: str,
                   baselines: AcceptanceBaselines, settings: AcceptanceSettings, update_command: str) -> CheckResult:
    """The acceptance_baseline result of a cell: its measured acceptance (the acceptance check's
    metrics: per-step traces or the engine's counters) against the stored baseline of its key."""
    mean = acceptance.metrics.get("mean_accepted_length")
    if mean is None:
        return CheckResult(BASELINE_CHECK, Verdict.SKIP, f"no acceptance measured ({acceptance.verdict.value}: "
                                                         f"{acceptance.reason})")
    try:
        key = key_of_run(par, model, engine)
    except RunError as exc:
        return CheckResult(BASELINE_CHECK, Verdict.ERROR, str(exc))
    return gate_acceptance(baselines, key, float(mean), acceptance.metrics.get("histogram"), settings, update_command)


def entries_from_cells(cells: list[CellResult], provenance: Mapping[str, Any], run_id: str,
                       created: str) -> tuple[list[AcceptanceBaseline], list[str]]:
    """Acceptance baselines from a run's -draft / -mtp cells: the reference run's measurement under its
    key (every cell of one key shares that reference), and why other cells give none. Cells with a
    fault, an ERROR or an acceptance check that did not pass are skipped."""
    found: dict[AcceptanceKey, AcceptanceBaseline] = {}
    skipped: list[str] = []
    for cell in cells:
        spec = cell.details.get("speculator")
        if not isinstance(spec, Mapping) or not spec.get("baseline_key"):
            continue
        check = next((c for c in cell.checks if c.name == "acceptance"), None)
        why = unrecordable(cell) or ("its acceptance check did not pass"
                                     if check is None or check.verdict not in (Verdict.PASS, Verdict.WARN)
                                     else "no reference mean accepted length"
                                     if spec.get("reference_mean_acceptance") is None else None)
        if why is not None:
            skipped.append(f"skip acceptance of {cell.model} / {cell.topology} (seed {cell.seed}): {why}")
            continue
        key = AcceptanceKey.from_dict(f"cell {cell.model} / {cell.topology}", spec["baseline_key"])
        hist = spec.get("reference_histogram")
        prov = measured_by(provenance, cell, run_id, created, suite=cell.suite,
                           reference_topology=provenance.get("reference"))
        entry = AcceptanceBaseline(key, float(spec["reference_mean_acceptance"]),
                                   tuple(hist) if hist is not None else None, prov)
        old = found.get(key)
        changed = old is not None and (old.mean_accepted_length, old.histogram) != (entry.mean_accepted_length,
                                                                                  entry.histogram)
        if changed:
            raise ConfigError(f"two cells of the run give different reference acceptance for {key.label} "
                              f"({old.mean_accepted_length} vs {entry.mean_accepted_length}); record from one run")
        found.setdefault(key, entry)
    return list(found.values()), skipped

