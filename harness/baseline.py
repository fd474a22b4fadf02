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

Written only by `harness baseline update --from RUN_DIR`, which shows the diff first.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

import yaml

from harness.errors import ConfigError
from harness.gsm8k.records import STRICT
from harness.gsm8k.settings import GSM8KSettings
from harness.gsm8k.stats import baseline_gate
from harness.jsonio import write_text_atomic
from harness.paths import BASELINES_DIR
from harness.specs.loader import check_keys, expect_int, read_versioned_list
from harness.verdict import CellResult, CheckResult, Verdict

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

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "task": self.task, "topology": self.topology, "n": self.n,
                "filter": self.filter, "score": float(self.score), "stderr": float(self.stderr),
                "provenance": dict(self.provenance)}


@dataclass(frozen=True)
class Baselines:
    """All baselines of one suite."""

    suite: str
    entries: tuple[BaselineEntry, ...] = ()

    def get(self, key: tuple[str, str, str, int]) -> BaselineEntry | None:
        return next((e for e in self.entries if e.key == key), None)

    def matching(self, model: str, task: str, topology: str) -> list[BaselineEntry]:
        return [e for e in self.entries if (e.model, e.task, e.topology) == (model, task, topology)]

    def merged(self, updates: list[BaselineEntry]) -> "Baselines":
        """These baselines with `updates` replacing entries of the same key, sorted by key."""
        by_key = {e.key: e for e in self.entries}
        by_key.update({e.key: e for e in updates})
        return replace(self, entries=tuple(by_key[k] for k in sorted(by_key)))

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
    provenance = data.get("provenance") or {}
    if not isinstance(provenance, Mapping):
        raise ConfigError(f"{where}: provenance must be a mapping, got {provenance!r}")
    return BaselineEntry(model=str(data["model"]), task=str(data["task"]), topology=str(data["topology"]),
                         n=data["n"], score=data["score"], stderr=data["stderr"],
                         filter=str(data.get("filter", STRICT)), provenance=dict(provenance))


def read_baselines(path: Path, suite: str | None = None) -> Baselines:
    """Parse a baselines file; a missing file is an empty set for `suite` (default: the file's stem)."""
    if not path.is_file():
        return Baselines(suite=suite or path.stem)
    data, raw = read_versioned_list(path, ("schema_version", "suite", "baselines"), BASELINE_SCHEMA_VERSION)
    entries = [_entry(f"{path} baselines[{i}]", e) for i, e in enumerate(raw)]
    keys = [e.key for e in entries]
    dupes = sorted({e.label for e in entries if keys.count(e.key) > 1})
    if dupes:
        raise ConfigError(f"{path}: duplicate baselines for {', '.join(dupes)}")
    return Baselines(suite=str(data.get("suite", suite or path.stem)), entries=tuple(entries))


def load_baselines(suite: str, folder: Path = BASELINES_DIR) -> Baselines:
    return read_baselines(baselines_path(suite, folder), suite)


def write_baselines(baselines: Baselines, path: Path) -> None:
    """Write atomically (a crash never leaves half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header = "# GSM8K baselines; written by `harness baseline update --from RUN_DIR` (edit with care).\n"
    write_text_atomic(path, header + yaml.safe_dump(baselines.to_dict(), sort_keys=False, allow_unicode=True))


def entry_from_cell(cell: CellResult, provenance: Mapping[str, Any], run_id: str, created: str) -> BaselineEntry:
    """A baseline from one cell's details["gsm8k"] and the run's provenance."""
    gsm = cell.details["gsm8k"]
    where = f"cell {cell.model} / {cell.topology}: details['gsm8k']"
    check_keys(where, gsm, tuple(gsm), required=("task", "n", "score", "stderr"))
    dtypes = provenance.get("dtypes")
    prov = {"harness_version": provenance.get("harness_version"),
            "engine": provenance.get("engine", f"embedded reference engine (torch {provenance.get('torch_version')})"),
            "git_commit": provenance.get("git_commit"), "device": provenance.get("device"),
            "dtype": ",".join(dtypes) if isinstance(dtypes, list) else provenance.get("dtype"),
            "seed": cell.seed, "date": created, "run_id": run_id, "command": cell.command}
    return BaselineEntry(model=cell.model, task=str(gsm["task"]), topology=cell.topology, n=gsm["n"],
                         score=float(gsm["score"]), stderr=float(gsm["stderr"]),
                         filter=str(gsm.get("filter", STRICT)), provenance=prov)


def skip_reason(cell: CellResult) -> str | None:
    """Why a cell must not become a baseline, or None when it may."""
    if cell.fault:
        return f"fault {cell.fault!r} injected: a positive control is not a baseline"
    if not cell.clean_exit or cell.status is Verdict.ERROR:
        return "the run broke (ERROR)"
    if "gsm8k" not in cell.details:
        return "no GSM8K result"
    return None


def diff_lines(old: Baselines, updates: list[BaselineEntry]) -> tuple[list[str], int]:
    """Human-readable diff of applying `updates` to `old`, and the number of entries that change."""
    lines: list[str] = []
    changed = 0
    for new in sorted(updates, key=lambda e: e.key):
        cur = old.get(new.key)
        if cur is None:
            changed += 1
            lines.append(f"+ {new.label}: score {new.score:.4f}, stderr {new.stderr:.4f} ({new.filter}) [new]")
            continue
        fields = _changed_fields(cur.to_dict(), new.to_dict())
        if not fields:
            lines.append(f"= {new.label}: unchanged")
            continue
        changed += 1
        lines.append(f"~ {new.label}:")
        lines += [f"    {name}: {a!r} -> {b!r}" for name, a, b in fields]
    return lines, changed


def _changed_fields(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any, Any]]:
    out: list[tuple[str, Any, Any]] = []
    for name in list(old) + [k for k in new if k not in old]:
        a, b = old.get(name), new.get(name)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out += _changed_fields(a, b, f"{prefix}{name}.")
        elif a != b:
            out.append((f"{prefix}{name}", a, b))
    return out


def update_command(run_dir: str, suite: str) -> str:
    return f"harness baseline update --from {run_dir} --suite {suite}"


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
