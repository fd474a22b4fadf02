"""Stored GSM8K baselines: one versioned YAML file per suite, and the gate of a cell against it.

File baselines/<suite>.yaml (schema BASELINE_SCHEMA_VERSION):

    schema_version: 1
    suite: gsm8k
    baselines:
    - model: smollm2-135m          # identity: model, task variant, topology and n (the first n
      task: gsm8k                  #   test questions; profiles with other limits get their own)
      topology: tp1
      n: 50
      filter: strict-match         # the lm-eval filter the score was taken with
      score: 0.06                  # exact match, 0..1
      stderr: 0.0339
      provenance: {harness_version, engine, git_commit, device, dtype, seed, date, run_id, command}

Written only by `harness baseline update --from RUN_DIR`, which shows the diff first. The file is read,
diffed and written by the one baseline store, under its provenance rule (harness/baselines/baseline_store.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from harness.baselines.baseline_store import (
    BaselineSet,
    measured_by,
    provenance_of,
    read_entries,
    unrecordable,
    update_command,
    write_file,
)
from harness.core.errors import ConfigError
from harness.core.paths import BASELINES_DIR
from harness.core.verdict import CellResult, CheckResult, Verdict
from harness.gsm8k.records import STRICT
from harness.gsm8k.settings import GSM8KSettings
from harness.gsm8k.stats import baseline_gate
from harness.specs.loader import check_keys, expect_int

BASELINE_SCHEMA_VERSION = 1
GATE_CHECK = "gsm8k_baseline"
PROVENANCE_KEYS: tuple[str, ...] = ("harness_version", "engine", "git_commit", "device", "dtype", "seed", "date",
                                    "run_id", "command")
_ENTRY_KEYS: tuple[str, ...] = ("model", "task", "topology", "n", "filter", "score", "stderr", "provenance")


@dataclass(frozen=True)
class BaselineEntry:
    """The expected score of one (model, task variant, topology, n), with how it was measured."""

    model: str
    task: str
    topology: str
    n: int
    score: float
    stderr: float
    filter: str = STRICT
    provenance: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = f"baseline {self.label}"
        expect_int(where, "n", self.n, minimum=1)
        for name in ("score", "stderr"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ConfigError(f"{where}: {name}={value!r} must be a number in 0..1")

    @property
    def key(self) -> tuple[str, str, str, int]:
        return (self.model, self.task, self.topology, self.n)

    @property
    def label(self) -> str:
        return f"{self.model} / {self.task} / {self.topology} / n={self.n}"

    @property
    def sort_key(self) -> tuple[str, str, str, int]:
        return self.key

    def summary(self) -> str:
        return f"score {self.score:.4f}, stderr {self.stderr:.4f} ({self.filter})"

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "task": self.task, "topology": self.topology, "n": self.n,
                "filter": self.filter, "score": float(self.score), "stderr": float(self.stderr),
                "provenance": dict(self.provenance)}


@dataclass(frozen=True)
class Baselines(BaselineSet[BaselineEntry]):
    """All baselines of one suite."""

    suite: str = ""

    def matching(self, model: str, task: str, topology: str) -> list[BaselineEntry]:
        return [e for e in self.entries if (e.model, e.task, e.topology) == (model, task, topology)]

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": BASELINE_SCHEMA_VERSION, "suite": self.suite,
                "baselines": [e.to_dict() for e in self.entries]}


@dataclass(frozen=True)
class Measurement:
    """A cell's measured GSM8K score (0..1) on its first n questions."""

    score: float
    n: int
    stderr: float = 0.0
    filter: str = STRICT


def baselines_path(suite: str, folder: Path = BASELINES_DIR) -> Path:
    return folder / f"{suite}.yaml"


def _entry(where: str, data: Any) -> BaselineEntry:
    check_keys(where, data, _ENTRY_KEYS, required=("model", "task", "topology", "n", "score", "stderr"))
    return BaselineEntry(model=str(data["model"]), task=str(data["task"]), topology=str(data["topology"]),
                         n=data["n"], score=data["score"], stderr=data["stderr"],
                         filter=str(data.get("filter", STRICT)), provenance=provenance_of(where, data))


def read_baselines(path: Path, suite: str | None = None) -> Baselines:
    """Parse a baselines file; a missing file is an empty set for `suite` (default: the file's stem)."""
    if not path.is_file():
        return Baselines(suite=suite or path.stem)
    data, entries = read_entries(path, ("schema_version", "suite", "baselines"), BASELINE_SCHEMA_VERSION,
                                 "baselines", _entry)
    return Baselines(suite=str(data.get("suite", suite or path.stem)), entries=tuple(entries))


def load_baselines(suite: str, folder: Path = BASELINES_DIR) -> Baselines:
    return read_baselines(baselines_path(suite, folder), suite)


def write_baselines(baselines: Baselines, path: Path) -> None:
    """Write atomically (a crash never leaves half a file)."""
    write_file(path, "# GSM8K baselines; written by `harness baseline update --from RUN_DIR` (edit with care).\n",
               baselines.to_dict())


def entry_from_cell(cell: CellResult, provenance: Mapping[str, Any], run_id: str, created: str) -> BaselineEntry:
    """A baseline from one cell's details["gsm8k"] and the run's provenance."""
    gsm = cell.details["gsm8k"]
    where = f"cell {cell.model} / {cell.topology}: details['gsm8k']"
    check_keys(where, gsm, tuple(gsm), required=("task", "n", "score", "stderr"))
    dtypes = provenance.get("dtypes")
    prov = measured_by(provenance, cell, run_id, created,
                       engine=provenance.get("engine",
                                             f"embedded reference engine (torch {provenance.get('torch_version')})"),
                       dtype=",".join(dtypes) if isinstance(dtypes, list) else provenance.get("dtype"), seed=cell.seed)
    return BaselineEntry(model=cell.model, task=str(gsm["task"]), topology=cell.topology, n=gsm["n"],
                         score=float(gsm["score"]), stderr=float(gsm["stderr"]),
                         filter=str(gsm.get("filter", STRICT)), provenance=prov)


def skip_reason(cell: CellResult) -> str | None:
    """Why a cell must not become a baseline, or None when it may."""
    reason = unrecordable(cell)
    if reason is not None:
        return reason
    if "gsm8k" not in cell.details:
        return "no GSM8K result"
    return None


def gate_cell(baselines: Baselines, model: str, task: str, topology: str, measured: Measurement,
              settings: GSM8KSettings | None = None, run_dir: str = "RUN_DIR") -> CheckResult:
    """Gate a cell's measured score against its stored baseline (stats.baseline_gate).

    WARN, naming the `harness baseline update` command, when no baseline exists for this model,
    task, topology and n, or when the baseline was scored with another filter.
    """
    cfg = settings if settings is not None else GSM8KSettings()
    entry = baselines.get((model, task, topology, measured.n))
    command = update_command(run_dir, baselines.suite)
    if entry is None:
        others = sorted(e.n for e in baselines.matching(model, task, topology))
        also = f" (baselines exist for n={', '.join(map(str, others))})" if others else ""
        return CheckResult(GATE_CHECK, Verdict.WARN,
                           f"no baseline for {model} / {task} / {topology} / n={measured.n} in suite "
                           f"{baselines.suite!r}{also}; record one with `{command}`",
                           {"measured": measured.score, "n": measured.n, "update_command": command})
    if entry.filter != measured.filter:
        return CheckResult(GATE_CHECK, Verdict.WARN,
                           f"baseline {entry.label} was scored with {entry.filter}, this run with "
                           f"{measured.filter}; re-record it with `{command}`",
                           {"measured": measured.score, "n": measured.n, "update_command": command})
    outcome = baseline_gate(entry.score, measured.score, measured.n, alpha=cfg.alpha, beta=cfg.beta,
                            sigma=cfg.sigma, detect_drop=cfg.detect_drop)
    metrics = {"headline": "measured", **outcome.metrics(), "baseline_stderr": entry.stderr,
               "measured_stderr": measured.stderr,
               "baseline_provenance": dict(entry.provenance)}
    return CheckResult(GATE_CHECK, outcome.verdict, outcome.reason, metrics)
