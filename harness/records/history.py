"""The history store: every recorded run's cells x checks in one SQLite file (standard library only).

One row per (run, cell, check): verdict, reason, key metric, noise multiples, and the run's
identity (run id, when it was created, git commit, engine and engine version, build label).
A cell is (suite, model, topology, seed); a workload other than the suite's prompts is part of its
topology column ("tp4dcp4/lengths", cell_topology). A trend is keyed by (cell, fault, check): a run with an
injected fault (`--fault`) is a positive control, so its rows form their own trend (a control, whose
FAIL means "still detected") and never count as a flip of the clean cell.

A build is the code under test: (git commit, engine version, build label). The runs of one build
(the unsharded run, a shard merge, a rerun) are one build, not several: a merged run's rows that
repeat a recorded source run's rows (`harness report A B` of shards already recorded) are not
counted twice.

Trend marks (per cell x fault x check, runs in creation order):
- flaky: the verdict flips between PASS and FAIL between consecutive runs of the same build; the
  flip count is reported. A flaky check is a harness defect.
- new failure: the latest build's last run FAILs or ERRORs where the build before it did not.
- fixed: the latest build's last run passes (PASS or WARN) where the build before it FAILed or ERRORed.
- control (fault runs): still detected (the latest run FAILs) or not detected (it passes).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sqlite3
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from harness.core.checkmetrics import key_metric, noise_multiples
from harness.core.errors import ConfigError
from harness.core.verdict import CellResult
from harness.records.results import read_results
from harness.specs.workload import SUITE_PROMPTS

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
CREATE TABLE IF NOT EXISTS merged_from (run_id TEXT NOT NULL, source_run_id TEXT NOT NULL,
    PRIMARY KEY (run_id, source_run_id));
CREATE TABLE IF NOT EXISTS launch_times (run_id TEXT NOT NULL, suite TEXT NOT NULL, model TEXT NOT NULL,
    topology TEXT NOT NULL, fault TEXT NOT NULL, seed INTEGER NOT NULL, wall_s REAL NOT NULL,
    PRIMARY KEY (run_id, suite, model, topology, fault, seed));
"""

CellId = tuple[str, str, str, int]  # (suite, model, topology, seed)
TrendKey = tuple[str, str, str, int, str | None]  # (suite, model, topology, seed, fault)


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
    def key(self) -> TrendKey:
        """The trend this row belongs to: the cell and its injected fault (None for a clean run)."""
        return (self.suite, self.model, self.topology, self.seed, self.fault)

    @property
    def code(self) -> tuple[str, str, str]:
        """What identifies the code under test (the build): a flip within one build is flakiness."""
        return (self.git_commit, self.engine_version, self.build_label)

    @property
    def build(self) -> str:
        """The build's name as shown: its label, else the commit's first 10 characters."""
        return self.build_label or (self.git_commit[:10] if self.git_commit else "?")


@dataclass(frozen=True)
class Trend:
    """One cell x fault x check over the recorded runs (oldest first)."""

    cell: CellId
    fault: str | None     # a positive control's injected fault; None for the clean cell
    check: str
    rows: tuple[Row, ...]
    flips: int            # PASS<->FAIL flips between consecutive runs of the same build
    new_failure: bool     # never set for a control: its FAIL is the expected detection
    fixed: bool

    @property
    def flaky(self) -> bool:
        return self.flips > 0

    @property
    def control(self) -> bool:
        return self.fault is not None

    @property
    def detected(self) -> bool:
        """A control whose latest run FAILs this check: the fault is still detected by it."""
        return self.control and self.rows[-1].verdict == "FAIL"

    @property
    def cell_label(self) -> str:
        suite, model, topo, seed = self.cell
        return f"{suite}/{model}/{topo}/seed{seed}" + (f" [fault {self.fault}]" if self.fault else "")

    @property
    def label(self) -> str:
        return f"{self.cell_label} {self.check}"


def history_path(given: Path | str | None) -> Path | None:
    """--history, else $HARNESS_HISTORY, else None (no history)."""
    if given:
        return Path(given)
    env = os.environ.get(HISTORY_ENV)
    return Path(env) if env else None


def check_store(path: Path) -> None:
    """Before a run records into `path`: an existing file must open as a history store (one ConfigError now,
    not after the whole run); a new one is created on recording."""
    if path.exists():
        connect(path, create=False).close()


def connect(path: Path, create: bool = True) -> sqlite3.Connection:
    """Open (and with `create`, initialise) the store; a file that is not one, a folder, or a path where no
    database can be created is one ConfigError."""
    if path.is_dir():
        raise ConfigError(f"history {path} is a folder, not a history database; give the database file's path "
                          f"(e.g. {path / 'history.db'})")
    if not create and not path.is_file():
        raise ConfigError(f"history {path} does not exist (record a run with: harness history add RUN_DIR)")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"history {path}: cannot create its folder {path.parent} ({exc.strerror or exc}); "
                          f"give a path in a folder you can write to") from None
    read_only = not create and _read_only(path)  # shown from a read-only disk: read as it is, never written
    try:
        conn = sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True) if read_only else sqlite3.connect(path)
        conn.text_factory = _text  # a damaged store's bytes are read as text, never a UnicodeDecodeError
        if not read_only:
            conn.executescript(_SCHEMA)
            conn.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            conn.commit()
        found = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        version = found[0] if found else None
    except (sqlite3.DatabaseError, UnicodeDecodeError) as exc:  # damaged pages; a schema text that is not UTF-8
        raise ConfigError(_store_error(path, exc)) from exc
    if version != str(SCHEMA_VERSION):
        raise ConfigError(f"history {path} has schema_version {version}; this harness reads {SCHEMA_VERSION}")
    return conn


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")


@contextlib.contextmanager
def reading_store(path: Path) -> Iterator[None]:
    """Reading the store at `path`: a damaged one (sqlite's "database disk image is malformed", found only when
    its pages are read) is one ConfigError naming it."""
    try:
        yield
    except (sqlite3.DatabaseError, UnicodeDecodeError) as exc:
        raise ConfigError(_store_error(path, exc)) from exc


def _store_error(path: Path, exc: sqlite3.Error | UnicodeDecodeError) -> str:
    """Why the store at `path` cannot be opened or written, as one line."""
    if isinstance(exc, sqlite3.OperationalError) and not path.exists():
        return f"history {path} cannot be created ({exc}); give a path in a folder you can write to"
    if isinstance(exc, sqlite3.OperationalError) and (_read_only(path) or "readonly" in str(exc)):
        where = " on a read-only file system" if _read_only(path) else ""
        return (f"history {path} cannot be written{where} ({exc}); record into a database on a writable disk "
                f"(its earlier runs stay readable: harness history show)")
    return f"history {path} cannot be opened as a harness history database ({exc})"


def _read_only(path: Path) -> bool:
    """Whether the file system holding `path` (or its folder) is mounted read-only."""
    try:
        return bool(os.statvfs(path if path.exists() else path.parent).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _created(run_dir: Path) -> str:
    path = run_dir if run_dir.is_file() else run_dir / "results.json"
    doc = json.loads(path.read_text())
    created = doc.get("created")
    return str(created) if created else datetime.now(timezone.utc).isoformat(timespec="seconds")


def rows_of(cells: Sequence[CellResult], run_id: str, created: str, provenance: dict[str, Any],
            build_label: str) -> list[Row]:
    """The rows one run contributes: one per cell x check (a cell its run never reached has no verdict: none)."""
    commit, engine_version = str(provenance.get("git_commit", "unknown")), str(provenance.get("engine_version", ""))
    rows = []
    for cell in (c for c in cells if not c.not_run):
        for check in cell.checks:
            key = key_metric(check)
            multiples = noise_multiples(check)
            rows.append(Row(run_id=run_id, created=created, suite=cell.suite, model=cell.model,
                            topology=cell_topology(cell), seed=cell.seed, fault=cell.fault,
                            cell_status=cell.status.value, check=check.name, verdict=check.verdict.value,
                            reason=check.reason, key_metric=key[0] if key else None,
                            key_value=key[1] if key else None, noise_multiples=multiples,
                            max_noise_multiple=max(multiples.values()) if multiples else None,
                            git_commit=commit, engine_version=engine_version, build_label=build_label))
    return rows


def source_run_ids(provenance: dict[str, Any]) -> list[str]:
    """The run ids a merged run (`harness report A B`) was merged from; [] for a run of its own."""
    sources = provenance.get("sources")
    if not isinstance(sources, list):
        return []
    return [str(s["run_id"]) for s in sources if isinstance(s, dict) and s.get("run_id")]


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
    times: list[tuple[str, str, str, str, int, float]]  # (suite, model, topology, fault or "", seed, wall_s)


def load_run_rows(run_dir: Path, build_label: str | None = None) -> LoadedRun:
    """Read run_dir's results.json into the rows `add_run` records; a bad folder is one ConfigError."""
    cells, provenance, run_id = read_results(run_dir)
    label = build_label if build_label is not None else str(  # an engine build label names the build too
        provenance.get("build_label") or os.environ.get(BUILD_LABEL_ENV, "") or provenance.get("engine_build") or "")
    created = _created(run_dir)
    rows = rows_of(cells, run_id, created, provenance, label)
    suites = sorted({c.suite for c in cells}) or [str(provenance.get("suite", ""))]
    times = {(c.suite, c.model, c.topology, c.fault or "", c.seed): c.wall_s for c in cells
             if not c.not_run and c.wall_s > 0 and c.run_dir and c.run_dir != c.reference_dir}  # launched here
    return LoadedRun(run_dir, run_id, created, label, provenance, suites, rows,
                     [(*k, w) for k, w in times.items()])


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
        except sqlite3.Error as exc:  # a read-only or full disk, a locked store
            raise ConfigError(_store_error(path, exc)) from exc
        finally:
            conn.close()
    except BaseException:
        if not existed:
            for leftover in (path, path.with_name(path.name + "-journal")):
                with contextlib.suppress(OSError):  # none there, or a path under a file
                    leftover.unlink()
        raise
    return out


def add_run(conn: sqlite3.Connection, run_dir: Path, build_label: str | None = None) -> tuple[str, int]:
    """Record run_dir's results.json; recording the same run (run id and suites) again replaces it.
    A merged run also records the run ids it was merged from. (run id, rows)."""
    run = load_run_rows(run_dir, build_label)
    with conn:
        return _insert(conn, run)


def _insert(conn: sqlite3.Connection, run: LoadedRun) -> tuple[str, int]:
    """The rows of `run` written (the caller commits)."""
    run_dir, run_id, created, label, provenance, suites, rows, _ = (
        run.run_dir, run.run_id, run.created, run.label, run.provenance, run.suites, run.rows, run.times)
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
    conn.execute("DELETE FROM launch_times WHERE run_id = ?", (run_id,))
    conn.executemany("INSERT OR REPLACE INTO launch_times VALUES (?,?,?,?,?,?,?)",
                     [(run_id, *t) for t in run.times])
    conn.execute("DELETE FROM merged_from WHERE run_id = ?", (run_id,))
    conn.executemany("INSERT OR IGNORE INTO merged_from VALUES (?, ?)",
                     [(run_id, src) for src in source_run_ids(provenance) if src != run_id])
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
    for n, rec in enumerate(conn.execute(sql, args).fetchall()):
        try:
            row = Row(run_id=rec[0], created=rec[1], suite=rec[2], model=rec[3], topology=rec[4], seed=int(rec[5]),
                      fault=rec[6], cell_status=rec[7], check=rec[8], verdict=rec[9], reason=rec[10],
                      key_metric=rec[11], key_value=rec[12], noise_multiples=json.loads(rec[13]),
                      max_noise_multiple=rec[14], git_commit=rec[15], engine_version=rec[16], build_label=rec[17])
        except (ValueError, TypeError) as exc:  # a damaged row: a seed or noise multiples that do not parse
            raise ConfigError(f"history row {n + 1} of the checks table (run {rec[0]!r}) is damaged ({exc}); "
                              f"record the runs into a new database (harness history add RUN_DIR)") from None
        if not patterns or any(_matches(p, row) for p in patterns):
            out.append(row)
    return drop_merge_repeats(out, _merged_from(conn))


def _merged_from(conn: sqlite3.Connection) -> dict[str, set[str]]:
    merged: dict[str, set[str]] = {}
    for run_id, source in conn.execute("SELECT run_id, source_run_id FROM merged_from").fetchall():
        merged.setdefault(run_id, set()).add(source)
    return merged


def drop_merge_repeats(rows: Sequence[Row], merged_from: dict[str, set[str]]) -> list[Row]:
    """Rows without a merged run's copies of rows its recorded source runs already hold (one result, one run)."""
    recorded = {(r.run_id, r.key, r.check) for r in rows}
    return [r for r in rows
            if not any((src, r.key, r.check) in recorded for src in merged_from.get(r.run_id, ()))]


def _matches(pattern: str, row: Row) -> bool:
    name = f"{row.suite}/{row.model}/{row.topology}/seed{row.seed}"
    return pattern in (row.topology, f"{row.model}/{row.topology}") or pattern in name


def _is_fail(verdict: str) -> bool:
    return verdict in ("FAIL", "ERROR")


def _is_pass(verdict: str) -> bool:
    return verdict in ("PASS", "WARN")


def builds(rows: Sequence[Row]) -> list[list[Row]]:
    """Rows grouped by build (commit, engine version, build label), builds in order of their first run."""
    groups: dict[tuple[str, str, str], list[Row]] = {}
    for row in rows:
        groups.setdefault(row.code, []).append(row)
    return list(groups.values())


def count_flips(rows: Sequence[Row]) -> int:
    """PASS<->FAIL flips between consecutive runs of the same build (commit, engine version, build label).
    `rows` are one trend's (one cell, one fault, one check), oldest first."""
    return sum(1 for group in builds(rows) for a, b in zip(group, group[1:])
               if {a.verdict, b.verdict} == {"PASS", "FAIL"})


def trends(rows: Sequence[Row]) -> list[Trend]:
    """One Trend per cell x fault x check, in first-seen order. New failure and fixed compare the check in
    the cell's latest run with the same check in the latest run of the build before (a check absent there,
    e.g. the `run` check of an ERROR that was not one before, did not fail); reruns of one build are
    flips, not fixes; a check absent from the cell's latest run has no mark. A control (a fault run) is
    never a new failure or a fix: its FAIL is the detection it exists for."""
    groups: dict[tuple[TrendKey, str], list[Row]] = {}
    runs: dict[TrendKey, list[tuple[str, tuple[str, str, str]]]] = {}  # the cell's runs, oldest first
    for row in rows:
        groups.setdefault((row.key, row.check), []).append(row)
        key_runs = runs.setdefault(row.key, [])
        if not key_runs or key_runs[-1][0] != row.run_id:
            key_runs.append((row.run_id, row.code))
    out = []
    for (key, check), group in groups.items():
        last, key_runs = group[-1], runs[key]
        before = [code for run_id, code in key_runs[:-1] if code != last.code]
        prev = [r for r in group if before and r.code == before[-1]]
        compared = key[4] is None and last.run_id == key_runs[-1][0] and bool(before)
        was_failing = bool(prev) and _is_fail(prev[-1].verdict)
        out.append(Trend(cell=key[:4], fault=key[4], check=check, rows=tuple(group), flips=count_flips(group),
                         new_failure=compared and _is_fail(last.verdict) and not was_failing,
                         fixed=compared and _is_pass(last.verdict) and was_failing))
    return out


@dataclass(frozen=True)
class RunPoint:
    """One recorded run of a cell: the cell's status, its largest noise multiple, the build it tested."""

    run_id: str
    status: str
    max_noise_multiple: float | None
    build: str
    code: tuple[str, str, str] = ("", "", "")  # (commit, engine version, build label)


@dataclass(frozen=True)
class CellHistory:
    """A cell's (or a positive control's) recent runs for the report, oldest first, and its marks."""

    runs: tuple[RunPoint, ...]
    flaky_checks: tuple[tuple[str, int], ...]  # (check, flips)
    new_failure: bool  # the cell FAILs or ERRORs in its latest run, not in the latest run of the build before
    fixed: bool        # it passes in its latest run, FAILed or ERRORed in the latest run of the build before
    fault: str | None = None  # a positive control's fault: its FAIL is "still detected"

    @property
    def builds(self) -> tuple[str, ...]:
        """The builds of the shown runs, oldest first, each once."""
        return tuple(dict.fromkeys(r.build for r in self.runs))

    @property
    def detected(self) -> bool | None:
        """A control: whether its latest run still FAILs (detects the fault); None for a clean cell."""
        return None if self.fault is None or not self.runs else self.runs[-1].status == "FAIL"


def cell_histories(rows: Sequence[Row], last: int = STRIP_RUNS) -> dict[TrendKey, CellHistory]:
    """Per cell and fault: its last `last` runs, its flaky checks, and whether it newly fails or was fixed."""
    by_key: dict[TrendKey, dict[str, RunPoint]] = {}
    for row in rows:
        runs = by_key.setdefault(row.key, {})
        seen = runs.get(row.run_id)
        m, worst_multiple = row.max_noise_multiple, seen.max_noise_multiple if seen else None
        if worst_multiple is not None and (m is None or m < worst_multiple):
            m = worst_multiple
        runs[row.run_id] = RunPoint(row.run_id, row.cell_status, m, row.build, row.code)
    flaky: dict[TrendKey, list[Trend]] = {}
    for trend in trends(rows):
        if trend.flaky:
            flaky.setdefault((*trend.cell, trend.fault), []).append(trend)
    out = {}
    for key, by_run in by_key.items():
        points = list(by_run.values())
        latest = points[-1]
        before = [p for p in points[:-1] if p.code != latest.code]
        compared = key[4] is None and bool(before)
        was_failing = bool(before) and _is_fail(before[-1].status)
        out[key] = CellHistory(
            runs=tuple(points[-last:]),
            flaky_checks=tuple((t.check, t.flips) for t in flaky.get(key, [])),
            new_failure=compared and _is_fail(latest.status) and not was_failing,
            fixed=compared and _is_pass(latest.status) and was_failing, fault=key[4])
    return out


def cell_topology(cell: CellResult) -> str:
    """The cell's topology column: its topology, with "/WORKLOAD" for a workload other than the suite's prompts."""
    return cell.topology if cell.workload == SUITE_PROMPTS else f"{cell.topology}/{cell.workload}"


def trend_key(cell: CellResult) -> TrendKey:
    return (cell.suite, cell.model, cell_topology(cell), cell.seed, cell.fault)


def histories_for(path: Path, cells: Sequence[CellResult], record: Path | None = None,
                  build_label: str | None = None) -> dict[TrendKey, CellHistory]:
    """The report's view of the store at `path` for `cells` (recording the run folder `record` first)."""
    conn = connect(path, create=record is not None)
    try:
        with reading_store(path):
            if record is not None:
                add_run(conn, record, build_label)
            wanted = {trend_key(c) for c in cells}
            rows = [r for suite in sorted({c.suite for c in cells}) for r in query(conn, suite) if r.key in wanted]
    finally:
        conn.close()
    rows.sort(key=lambda r: (r.created, r.run_id))
    return cell_histories(rows)


def measured_seconds(path: Path | None, last: int = 5) -> dict[tuple[str, str, str, str], float]:
    """The median wall time of the last `last` recorded launches of each (suite, model, topology, fault or ""),
    over its seeds: what `harness matrix` estimates a cell by. {} without a store, or one recorded before launch
    times were kept."""
    if path is None or not path.is_file():
        return {}
    conn = connect(path, create=False)
    try:
        with reading_store(path):
            if conn.execute("SELECT name FROM sqlite_master WHERE name = 'launch_times'").fetchone() is None:
                return {}
            found = conn.execute("SELECT t.suite, t.model, t.topology, t.fault, t.wall_s FROM launch_times t "
                                 "JOIN runs r ON r.run_id = t.run_id AND instr(r.suite, t.suite) > 0 "
                                 "ORDER BY r.created").fetchall()
    finally:
        conn.close()
    walls: dict[tuple[str, str, str, str], list[float]] = {}
    for suite, model, topology, fault, wall in found:
        walls.setdefault((suite, model, topology, fault), []).append(float(wall))
    out = {}
    for key, values in walls.items():
        recent = sorted(values[-last:])
        mid = len(recent) // 2
        out[key] = recent[mid] if len(recent) % 2 else (recent[mid - 1] + recent[mid]) / 2
    return out


@dataclass(frozen=True)
class RunStatus:
    """A cell's status in one recorded run, and the build that run tested."""

    run_id: str
    created: str
    status: str
    build: str
    git_commit: str


@dataclass(frozen=True)
class CellStory:
    """What on-call asks of one cell (and fault) over a window of runs, oldest first:
    is it failing now, since when (the streak's first run), its first failure in the window, how often it
    flipped between passing and failing, the last run that passed and the builds from there to the streak's
    start (where the regression came in: `harness bisect --good LAST_GOOD --bad STREAK_START`)."""

    key: TrendKey
    runs: tuple[RunStatus, ...]
    streak: tuple[RunStatus, ...]          # the runs of the current failing streak (empty: passing now)
    first_failure: RunStatus | None        # the first failing run in the window
    flips: int                             # pass <-> fail changes between consecutive runs (SKIPs left out)
    last_good: RunStatus | None            # the last passing run before the streak (or the latest, passing now)
    between: tuple[RunStatus, ...]         # the runs after last_good up to the streak's first run, inclusive

    @property
    def label(self) -> str:
        suite, model, topo, seed, fault = self.key
        return f"{suite}/{model}/{topo}/seed{seed}" + (f" [fault {fault}]" if fault else "")

    @property
    def failing(self) -> bool:
        return bool(self.streak)

    def to_dict(self) -> dict[str, Any]:
        def run(r: RunStatus | None) -> dict[str, str] | None:
            return None if r is None else {"run_id": r.run_id, "created": r.created, "status": r.status,
                                           "build": r.build, "git_commit": r.git_commit}
        return {"cell": self.label, "failing": self.failing, "runs": len(self.runs),
                "streak_start": run(self.streak[0]) if self.streak else None, "streak_runs": len(self.streak),
                "first_failure": run(self.first_failure), "flips": self.flips, "last_good": run(self.last_good),
                "between": [run(r) for r in self.between],
                "builds_between": list(dict.fromkeys(r.build for r in self.between))}


def cell_stories(rows: Sequence[Row]) -> list[CellStory]:
    """One CellStory per cell and fault in `rows` (the window's rows, oldest first), in first-seen order."""
    by_key: dict[TrendKey, dict[str, RunStatus]] = {}
    for row in rows:
        by_key.setdefault(row.key, {})[row.run_id] = RunStatus(row.run_id, row.created, row.cell_status,
                                                               row.build, row.git_commit)
    out = []
    for key, by_run in by_key.items():
        runs = [r for r in by_run.values() if r.status != "SKIP"]
        streak: list[RunStatus] = []
        for r in reversed(runs):
            if not _is_fail(r.status):
                break
            streak.insert(0, r)
        before = runs[:len(runs) - len(streak)]
        last_good = before[-1] if before else None
        every = list(by_run.values())  # SKIPs included: a build between may have skipped the cell
        first = every.index(last_good) + 1 if last_good is not None else 0
        between = tuple(every[first:every.index(streak[0]) + 1]) if streak else ()
        flips = sum(1 for a, b in zip(runs, runs[1:]) if _is_fail(a.status) != _is_fail(b.status))
        out.append(CellStory(key=key, runs=tuple(by_run.values()), streak=tuple(streak),
                             first_failure=next((r for r in runs if _is_fail(r.status)), None), flips=flips,
                             last_good=last_good, between=between))
    return out
