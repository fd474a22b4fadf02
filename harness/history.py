"""The history store: every recorded run's cells x checks in one SQLite file (standard library only).

One row per (run, cell, check): verdict, reason, key metric, noise multiples, and the run's
identity (run id, when it was created, git commit, engine and engine version, build label).
A cell is (suite, model, topology, seed); an injected fault is stored with the row but is not part
of the cell, so the same cell of a faulted and a clean run share one trend.

Trend marks (per cell x check, runs in creation order):
- flaky: the verdict flips between PASS and FAIL between consecutive runs of the same code
  (same git commit, engine version and build label); the flip count is reported. A flaky check is
  a harness defect.
- new failure: the latest run FAILs or ERRORs where the run before it did not.
- fixed: the latest run passes (PASS or WARN) where the run before it FAILed or ERRORed.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Iterable, Sequence

from harness.checkmetrics import key_metric, noise_multiples
from harness.errors import ConfigError
from harness.results import read_results
from harness.verdict import CellResult

HISTORY_ENV = "HARNESS_HISTORY"
BUILD_LABEL_ENV = "HARNESS_BUILD_LABEL"
SCHEMA_VERSION = 1
STRIP_RUNS = 10  # runs per cell in the report's history strip

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT NOT NULL, created TEXT NOT NULL, recorded TEXT NOT NULL, suite TEXT NOT NULL,
    git_commit TEXT NOT NULL, engine TEXT NOT NULL, engine_version TEXT NOT NULL, build_label TEXT NOT NULL,
    hostname TEXT NOT NULL, source TEXT NOT NULL, provenance TEXT NOT NULL, PRIMARY KEY (run_id, suite));
CREATE TABLE IF NOT EXISTS checks (
    run_id TEXT NOT NULL, created TEXT NOT NULL,
    suite TEXT NOT NULL, model TEXT NOT NULL, topology TEXT NOT NULL, seed INTEGER NOT NULL, fault TEXT,
    cell_status TEXT NOT NULL, check_name TEXT NOT NULL, verdict TEXT NOT NULL, reason TEXT NOT NULL,
    key_metric TEXT, key_value REAL, noise_multiples TEXT NOT NULL, max_noise_multiple REAL,
    git_commit TEXT NOT NULL, engine_version TEXT NOT NULL, build_label TEXT NOT NULL,
    PRIMARY KEY (run_id, suite, model, topology, seed, check_name));
CREATE INDEX IF NOT EXISTS checks_cell ON checks (suite, model, topology, seed, check_name, created);
"""

CellId = tuple[str, str, str, int]  # (suite, model, topology, seed)


@dataclass(frozen=True)
class Row:
    """One cell x check of one recorded run."""

    run_id: str
    created: str
    suite: str
    model: str
    topology: str
    seed: int
    fault: str | None
    cell_status: str
    check: str
    verdict: str
    reason: str
    key_metric: str | None
    key_value: float | None
    noise_multiples: dict[str, float]
    max_noise_multiple: float | None
    git_commit: str
    engine_version: str
    build_label: str

    @property
    def cell(self) -> CellId:
        return (self.suite, self.model, self.topology, self.seed)

    @property
    def code(self) -> tuple[str, str, str]:
        """What identifies the code under test: a flip within one code is flakiness."""
        return (self.git_commit, self.engine_version, self.build_label)


@dataclass(frozen=True)
class Trend:
    """One cell x check over the recorded runs (oldest first)."""

    cell: CellId
    check: str
    rows: tuple[Row, ...]
    flips: int            # PASS<->FAIL flips between consecutive runs of the same code
    new_failure: bool
    fixed: bool

    @property
    def flaky(self) -> bool:
        return self.flips > 0

    @property
    def label(self) -> str:
        suite, model, topo, seed = self.cell
        return f"{suite}/{model}/{topo}/seed{seed} {self.check}"


def history_path(given: Path | str | None) -> Path | None:
    """--history, else $HARNESS_HISTORY, else None (no history)."""
    if given:
        return Path(given)
    env = os.environ.get(HISTORY_ENV)
    return Path(env) if env else None


def connect(path: Path, create: bool = True) -> sqlite3.Connection:
    """Open (and with `create`, initialise) the store; a file that is not one is one ConfigError."""
    if not create and not path.is_file():
        raise ConfigError(f"history {path} does not exist (record a run with: harness history add RUN_DIR)")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        conn = sqlite3.connect(str(path))
        conn.executescript(_SCHEMA)
        conn.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        version = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0]
        conn.commit()
    except sqlite3.DatabaseError as exc:
        raise ConfigError(f"history {path} cannot be opened as a harness history database ({exc})") from exc
    if version != str(SCHEMA_VERSION):
        raise ConfigError(f"history {path} has schema_version {version}; this harness reads {SCHEMA_VERSION}")
    return conn


def _created(run_dir: Path) -> str:
    path = run_dir if run_dir.is_file() else run_dir / "results.json"
    doc = json.loads(path.read_text())
    created = doc.get("created")
    return str(created) if created else datetime.now(timezone.utc).isoformat(timespec="seconds")


def rows_of(cells: Sequence[CellResult], run_id: str, created: str, provenance: dict[str, Any],
            build_label: str) -> list[Row]:
    """The rows one run contributes: one per cell x check."""
    commit, engine_version = str(provenance.get("git_commit", "unknown")), str(provenance.get("engine_version", ""))
    rows = []
    for cell in cells:
        for check in cell.checks:
            key = key_metric(check)
            multiples = noise_multiples(check)
            rows.append(Row(run_id=run_id, created=created, suite=cell.suite, model=cell.model,
                            topology=cell.topology, seed=cell.seed, fault=cell.fault,
                            cell_status=cell.status.value, check=check.name, verdict=check.verdict.value,
                            reason=check.reason, key_metric=key[0] if key else None,
                            key_value=key[1] if key else None, noise_multiples=multiples,
                            max_noise_multiple=max(multiples.values()) if multiples else None,
                            git_commit=commit, engine_version=engine_version, build_label=build_label))
    return rows


@dataclass(frozen=True)
class LoadedRun:
    """One run folder's results.json, read and turned into rows (nothing written yet)."""

    run_dir: Path
    run_id: str
    created: str
    label: str
    provenance: dict[str, Any]
    suites: list[str]
    rows: list[Row]


def load_run_rows(run_dir: Path, build_label: str | None = None) -> LoadedRun:
    """Read run_dir's results.json into the rows `add_run` records; a bad folder is one ConfigError."""
    cells, provenance, run_id = read_results(run_dir)
    label = build_label if build_label is not None else str(
        provenance.get("build_label") or os.environ.get(BUILD_LABEL_ENV, ""))
    created = _created(run_dir)
    rows = rows_of(cells, run_id, created, provenance, label)
    suites = sorted({c.suite for c in cells}) or [str(provenance.get("suite", ""))]
    return LoadedRun(run_dir, run_id, created, label, provenance, suites, rows)


def record_runs(path: Path, run_dirs: Sequence[Path], build_label: str | None = None) -> list[tuple[str, int]]:
    """Record run folders into the store at `path` in one transaction: every folder is read before the
    store is touched, and a failure leaves the store as it was (a store this call created is removed)."""
    loaded = [load_run_rows(d, build_label) for d in run_dirs]
    existed = path.exists()
    try:
        conn = connect(path)
        try:
            with conn:
                out = [_insert(conn, run) for run in loaded]
        finally:
            conn.close()
    except BaseException:
        if not existed:
            for leftover in (path, path.with_name(path.name + "-journal")):
                leftover.unlink(missing_ok=True)
        raise
    return out


def add_run(conn: sqlite3.Connection, run_dir: Path, build_label: str | None = None) -> tuple[str, int]:
    """Record run_dir's results.json; recording the same run (run id and suites) again replaces it.
    (run id, rows)."""
    run = load_run_rows(run_dir, build_label)
    with conn:
        return _insert(conn, run)


def _insert(conn: sqlite3.Connection, run: LoadedRun) -> tuple[str, int]:
    """The rows of `run` written (the caller commits)."""
    run_dir, run_id, created, label, provenance, suites, rows = (
        run.run_dir, run.run_id, run.created, run.label, run.provenance, run.suites, run.rows)
    conn.executemany("DELETE FROM checks WHERE run_id = ? AND suite = ?", [(run_id, s) for s in suites])
    conn.execute("INSERT OR REPLACE INTO runs VALUES (?,?,?,?,?,?,?,?,?,?,?)", (
        run_id, created, datetime.now(timezone.utc).isoformat(timespec="seconds"), ",".join(suites),
        str(provenance.get("git_commit", "unknown")), str(provenance.get("engine", "")),
        str(provenance.get("engine_version", "")), label, str(provenance.get("hostname", "")),
        str(run_dir.resolve()), json.dumps(provenance, default=str)))
    conn.executemany("INSERT INTO checks VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", [
        (r.run_id, r.created, r.suite, r.model, r.topology, r.seed, r.fault, r.cell_status, r.check,
         r.verdict, r.reason, r.key_metric, r.key_value, json.dumps(r.noise_multiples),
         r.max_noise_multiple, r.git_commit, r.engine_version, r.build_label) for r in rows])
    return run_id, len(rows)


_SINCE_RE = re.compile(r"^(\d+)([dhw])$")


def parse_since(text: str, now: datetime | None = None) -> str:
    """'7d', '12h', '2w' or an ISO date/time -> an ISO timestamp (UTC) to compare `created` with."""
    now = now or datetime.now(timezone.utc)
    match = _SINCE_RE.match(text.strip())
    if match:
        n, unit = int(match.group(1)), match.group(2)
        delta = {"d": timedelta(days=n), "h": timedelta(hours=n), "w": timedelta(weeks=n)}[unit]
        return (now - delta).isoformat(timespec="seconds")
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ConfigError(f"--since {text!r} is neither an ISO date (2025-01-31) nor an age like 7d, 12h, 2w") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return when.astimezone(timezone.utc).isoformat(timespec="seconds")


def query(conn: sqlite3.Connection, suite: str | None = None, cells: Iterable[str] = (),
          since: str | None = None) -> list[Row]:
    """Rows, oldest run first, filtered by suite, cell patterns ('model/topology', 'topology' or a
    substring of 'suite/model/topology/seedN') and a creation time."""
    sql, args = "SELECT * FROM checks WHERE 1=1", []
    if suite:
        sql += " AND suite = ?"
        args.append(suite)
    if since:
        sql += " AND created >= ?"
        args.append(since)
    sql += " ORDER BY created, run_id, suite, model, topology, seed, rowid"
    patterns = list(cells)
    out = []
    for rec in conn.execute(sql, args).fetchall():
        row = Row(run_id=rec[0], created=rec[1], suite=rec[2], model=rec[3], topology=rec[4], seed=int(rec[5]),
                  fault=rec[6], cell_status=rec[7], check=rec[8], verdict=rec[9], reason=rec[10],
                  key_metric=rec[11], key_value=rec[12], noise_multiples=json.loads(rec[13]),
                  max_noise_multiple=rec[14], git_commit=rec[15], engine_version=rec[16], build_label=rec[17])
        if not patterns or any(_matches(p, row) for p in patterns):
            out.append(row)
    return out


def _matches(pattern: str, row: Row) -> bool:
    name = f"{row.suite}/{row.model}/{row.topology}/seed{row.seed}"
    return pattern in (row.topology, f"{row.model}/{row.topology}") or pattern in name


def _is_fail(verdict: str) -> bool:
    return verdict in ("FAIL", "ERROR")


def _is_pass(verdict: str) -> bool:
    return verdict in ("PASS", "WARN")


def count_flips(rows: Sequence[Row]) -> int:
    """PASS<->FAIL flips between consecutive runs of the same code (commit, engine version, build)."""
    return sum(1 for a, b in zip(rows, rows[1:])
               if a.code == b.code and {a.verdict, b.verdict} == {"PASS", "FAIL"})


def trends(rows: Sequence[Row]) -> list[Trend]:
    """One Trend per cell x check, in first-seen order."""
    groups: dict[tuple[CellId, str], list[Row]] = {}
    for row in rows:
        groups.setdefault((row.cell, row.check), []).append(row)
    out = []
    for (cell, check), group in groups.items():
        last, prev = group[-1], group[-2] if len(group) > 1 else None
        out.append(Trend(cell=cell, check=check, rows=tuple(group), flips=count_flips(group),
                         new_failure=prev is not None and _is_fail(last.verdict) and not _is_fail(prev.verdict),
                         fixed=prev is not None and _is_pass(last.verdict) and _is_fail(prev.verdict)))
    return out


@dataclass(frozen=True)
class CellHistory:
    """A cell's recent runs for the report: (run_id, cell status, max noise multiple) oldest first,
    and its marks."""

    runs: tuple[tuple[str, str, float | None], ...]
    flaky_checks: tuple[tuple[str, int], ...]  # (check, flips)
    new_failure: bool
    fixed: bool


def cell_histories(rows: Sequence[Row], last: int = STRIP_RUNS) -> dict[CellId, CellHistory]:
    """Per cell: its last `last` runs and the marks of its checks."""
    by_cell: dict[CellId, dict[str, tuple[str, float | None]]] = {}
    for row in rows:
        runs = by_cell.setdefault(row.cell, {})
        status, worst_multiple = runs.get(row.run_id, (row.cell_status, None))
        m = row.max_noise_multiple
        runs[row.run_id] = (status, m if worst_multiple is None or (m is not None and m > worst_multiple)
                            else worst_multiple)
    marks: dict[CellId, list[Trend]] = {}
    for trend in trends(rows):
        marks.setdefault(trend.cell, []).append(trend)
    out = {}
    for cell, runs in by_cell.items():
        cell_trends = marks.get(cell, [])
        out[cell] = CellHistory(
            runs=tuple((rid, s, m) for rid, (s, m) in list(runs.items())[-last:]),
            flaky_checks=tuple((t.check, t.flips) for t in cell_trends if t.flaky),
            new_failure=any(t.new_failure for t in cell_trends), fixed=any(t.fixed for t in cell_trends)
            and not any(_is_fail(t.rows[-1].verdict) for t in cell_trends))
    return out


def histories_for(path: Path, cells: Sequence[CellResult], record: Path | None = None,
                  build_label: str | None = None) -> dict[CellId, CellHistory]:
    """The report's view of the store at `path` for `cells` (recording the run folder `record` first)."""
    conn = connect(path, create=record is not None)
    try:
        if record is not None:
            add_run(conn, record, build_label)
        wanted = {(c.suite, c.model, c.topology, c.seed) for c in cells}
        rows = [r for suite in sorted({c.suite for c in cells}) for r in query(conn, suite) if r.cell in wanted]
    finally:
        conn.close()
    rows.sort(key=lambda r: (r.created, r.run_id))
    return cell_histories(rows)
