"""Verdicts: what every check returns, and how a cell's checks combine."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import Any


class ExitCode(IntEnum):
    """The CLI's exit codes (a process ended by signal S exits 128 + S, as a shell reports it)."""

    OK = 0           # every cell passed
    FAIL = 1         # a check failed
    USAGE = 2        # bad input or configuration, before anything ran
    ERROR = 3        # a cell could not run (and none failed)
    BROKEN_PIPE = 141  # 128 + SIGPIPE: the reader of the output closed the pipe


class Verdict(str, Enum):
    PASS = "PASS"
    WARN = "WARN"
    FAIL = "FAIL"
    ERROR = "ERROR"
    SKIP = "SKIP"

    @property
    def severity(self) -> int:
        return {"SKIP": 0, "PASS": 1, "WARN": 2, "ERROR": 3, "FAIL": 4}[self.value]


class FailureClass(str, Enum):
    """What a failing cell's failure means for a release: its outputs are wrong, only a speed figure
    regressed, or the run itself could not be completed."""

    OUTPUT = "output"                  # outputs or layout differ from the reference beyond the noise floor
    PERFORMANCE = "performance"        # only performance checks failed (draft acceptance): outputs agree
    INFRASTRUCTURE = "infrastructure"  # the run could not be completed (ERROR): no verdict on its outputs

    @property
    def label(self) -> str:
        return {"output": "output corruption", "performance": "performance-only",
                "infrastructure": "infrastructure"}[self.value]


NOT_RUN_CHECK = "not_run"  # the one check of a cell its run never reached (interrupted, disk full): an ERROR


def worst(verdicts: list[Verdict]) -> Verdict:
    """The cell status: the most severe verdict (FAIL over ERROR over WARN over PASS over SKIP)."""
    return max(verdicts, key=lambda v: v.severity) if verdicts else Verdict.SKIP


@dataclass(frozen=True)
class CheckResult:
    """One check of one cell: a verdict, a one-line reason, and the numbers behind it. `performance_only`:
    the check measures speed (e.g. draft acceptance), not outputs, so its FAIL is a performance regression
    (set from the check's registry entry)."""

    name: str
    verdict: Verdict
    reason: str
    metrics: dict[str, Any] = field(default_factory=dict)
    performance_only: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "verdict": self.verdict.value, "reason": self.reason, "metrics": self.metrics,
                "performance_only": self.performance_only}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CheckResult":
        return cls(name=data["name"], verdict=Verdict(data["verdict"]), reason=data["reason"],
                   metrics=dict(data.get("metrics") or {}), performance_only=bool(data.get("performance_only")))


@dataclass(frozen=True)
class Localization:
    """Where a parity failure starts: a layer, the diverging heads, the ranks owning them, the KV heads read."""

    layer: int
    heads: tuple[int, ...]
    ranks: tuple[int, ...]
    kv_heads: tuple[int, ...]
    summary: str

    def to_dict(self) -> dict[str, Any]:
        return {"layer": self.layer, "heads": list(self.heads), "ranks": list(self.ranks),
                "kv_heads": list(self.kv_heads), "summary": self.summary}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Localization":
        return cls(layer=data["layer"], heads=tuple(data["heads"]), ranks=tuple(data["ranks"]),
                   kv_heads=tuple(data["kv_heads"]), summary=data.get("summary", ""))


@dataclass(frozen=True)
class CellResult:
    """One cell of the matrix: (suite, model, topology, fault, seed, workload) and its checks.

    `details` holds per-cell drill-down data for the report (per-prompt metrics, per-layer errors,
    per-head heat map, first diverging token, layout tables); it is JSON-serialisable.
    """

    suite: str
    model: str
    topology: str
    fault: str | None
    seed: int
    checks: tuple[CheckResult, ...]
    clean_exit: bool
    localization: Localization | None = None
    command: str = ""
    run_dir: str = ""
    reference_dir: str = ""
    wall_s: float = 0.0
    error_log: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    engine: str = ""             # the backend of the parallel run (harness list engines)
    reference_engine: str = ""   # the backend of the reference run
    engine_env: dict[str, str] = field(default_factory=dict)  # the engine's own variables it ran with (engine_env)
    engine_build: str = ""       # the engine build label (--engine-build, or its template's build_argv)
    workload: str = "prompts"    # what the cell sent (harness/specs/workload.py; "prompts": the suite's prompts)
    condition: bool = False      # `fault` is a load condition (P/D store damage, a lost entry) a correct engine absorbs

    @property
    def control(self) -> bool:
        """A positive control: a cell run with an injected bug (--fault), whose FAIL is the bug flagged. A load
        condition's cell is none: it holds a correct engine to absorbing its surroundings' failure."""
        return bool(self.fault) and not self.condition

    @property
    def status(self) -> Verdict:
        return worst([c.verdict for c in self.checks])

    @property
    def failure_class(self) -> FailureClass | None:
        """Output corruption (a FAIL of a check on outputs or layout), performance-only (every FAIL is of a
        performance check), infrastructure (ERROR, and nothing FAILed); None when nothing failed."""
        failed = [c for c in self.checks if c.verdict is Verdict.FAIL]
        if failed:
            return FailureClass.PERFORMANCE if all(c.performance_only for c in failed) else FailureClass.OUTPUT
        return FailureClass.INFRASTRUCTURE if self.status is Verdict.ERROR else None

    @property
    def not_run(self) -> bool:
        """A cell its run never reached (stopped by a signal or a full disk first): no verdict on it."""
        return any(c.name == NOT_RUN_CHECK for c in self.checks)

    @property
    def silent_corruption(self) -> bool:
        """Output corruption in a run whose processes all exited cleanly."""
        return self.clean_exit and self.failure_class is FailureClass.OUTPUT

    def to_dict(self) -> dict[str, Any]:
        return {"suite": self.suite, "model": self.model, "topology": self.topology, "fault": self.fault,
                "seed": self.seed, "status": self.status.value, "silent_corruption": self.silent_corruption,
                "failure_class": self.failure_class.value if self.failure_class else None,
                "clean_exit": self.clean_exit,
                "localization": self.localization.to_dict() if self.localization else None,
                "checks": [c.to_dict() for c in self.checks], "command": self.command,
                "run_dir": self.run_dir, "reference_dir": self.reference_dir, "wall_s": self.wall_s,
                "error_log": self.error_log, "details": self.details, "engine": self.engine,
                "reference_engine": self.reference_engine, "engine_env": dict(self.engine_env),
                "engine_build": self.engine_build, "workload": self.workload, "condition": self.condition}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CellResult":
        loc = data.get("localization")
        return cls(suite=data["suite"], model=data["model"], topology=data["topology"], fault=data.get("fault"),
                   seed=int(data.get("seed", 0)), checks=tuple(CheckResult.from_dict(c) for c in data["checks"]),
                   clean_exit=bool(data.get("clean_exit", True)),
                   localization=Localization.from_dict(loc) if loc else None, command=data.get("command", ""),
                   run_dir=data.get("run_dir", ""), reference_dir=data.get("reference_dir", ""),
                   wall_s=float(data.get("wall_s", 0.0)), error_log=data.get("error_log", ""),
                   details=dict(data.get("details") or {}), engine=str(data.get("engine", "")),
                   reference_engine=str(data.get("reference_engine", "")),
                   engine_env={str(k): str(v) for k, v in (data.get("engine_env") or {}).items()},
                   engine_build=str(data.get("engine_build") or ""),
                   workload=str(data.get("workload") or "prompts"), condition=bool(data.get("condition", False)))
