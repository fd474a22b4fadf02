"""`harness history add RUN_DIR... | show`: record finished runs into the history store and show trends.

The store is one SQLite file: --history PATH, else $HARNESS_HISTORY. `show` prints one line per
cell x check (verdicts of its runs, oldest first: P pass, W warn, F fail, E error, S skip), its
latest key metric and noise multiple, and the marks NEW-FAIL, FIXED and FLAKY (PASS<->FAIL flips
between runs of one build: a harness defect, listed again at the end). A run with an injected fault is
a positive control: its lines are apart from the clean cell's ([fault NAME]), never a flip or a new
failure, and are summed up as "still detected" or "NOT detected". Exit 0; 1 when a check is flaky.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from harness.core.errors import ConfigError
from harness.core.verdict import ExitCode


def add_parser(sub: Any) -> None:
    p = sub.add_parser("history", help="record runs into the history store and show trends",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    hsub = p.add_subparsers(dest="history_command", required=True, parser_class=type(p))
    add = hsub.add_parser("add", help="record finished run folders (their results.json)")
    add.add_argument("dirs", nargs="+", type=Path, metavar="RUN_DIR")
    add.add_argument("--label", default=None,
                     help="build label (default: the run's provenance build_label, else $HARNESS_BUILD_LABEL)")
    show = hsub.add_parser("show", help="trend per cell x check, with new failures, fixes and flaky checks")
    show.add_argument("--suite", default=None, help="only this suite")
    show.add_argument("--cell", action="append", default=[], metavar="CELL",
                      help="only cells matching (topology, model/topology, or part of suite/model/topology/seedN); "
                           "repeatable")
    show.add_argument("--since", default=None, help="only runs created since (ISO date, or an age: 7d, 12h, 2w)")
    show.add_argument("--last", type=int, default=20, help="verdicts shown per line (default 20)")
    for sp in (add, show):
        sp.add_argument("--history", type=Path, default=None, help="history database (default: $HARNESS_HISTORY)")
    p.set_defaults(func=run)


def _store(args: argparse.Namespace) -> Path:
    from harness.records.history import HISTORY_ENV, history_path
    path = history_path(args.history)
    if path is None:
        raise ConfigError(f"no history store: give --history PATH or set {HISTORY_ENV}")
    return path


def run(args: argparse.Namespace) -> int:
    from harness.records.history import connect, reading_store, record_runs
    path = _store(args)
    if args.history_command == "add":
        for run_id, n in record_runs(path, args.dirs, args.label):
            print(f"recorded {run_id}: {n} cell x check rows into {path}")
        return ExitCode.OK
    conn = connect(path, create=False)
    try:
        with reading_store(path):
            return show(conn, args)
    finally:
        conn.close()


def _marks(t: Any) -> list[str]:
    if t.control:
        return ["CONTROL detected" if t.detected else "CONTROL"] + ([f"FLAKY({t.flips} flips)"] if t.flaky else [])
    return [m for m, on in (("NEW-FAIL", t.new_failure), ("FIXED", t.fixed), (f"FLAKY({t.flips} flips)", t.flaky))
            if on]


def show(conn: Any, args: argparse.Namespace) -> int:
    from harness.records.history import cell_histories, parse_since, query, trends
    from harness.report.matrix import format_number
    if args.last < 1:
        raise ConfigError(f"--last {args.last} must be >= 1")
    rows = query(conn, args.suite, args.cell, parse_since(args.since) if args.since else None)
    if not rows:
        print("no recorded runs match")
        return ExitCode.OK
    found = trends(rows)
    runs = sorted({(r.created, r.run_id) for r in rows})
    n_builds = len({r.code for r in rows})
    print(f"{len(runs)} runs of {n_builds} build{'s' if n_builds != 1 else ''} from {runs[0][0]} to {runs[-1][0]}; "
          f"{len(found)} cell x check trends")
    table = [("cell", "check", "runs (old -> new)", "last", "key metric", "x noise", "marks")]
    for t in found:
        last = t.rows[-1]
        key = f"{last.key_metric}={format_number(last.key_value)}" if last.key_metric else "-"
        noise = format_number(last.max_noise_multiple) if last.max_noise_multiple is not None else "-"
        table.append((t.cell_label, t.check, "".join(r.verdict[0] for r in t.rows[-args.last:]),
                      last.verdict, key, noise, " ".join(_marks(t))))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())
    cells = cell_histories(rows)
    for verb, mark in (("NEW-FAIL", "new_failure"), ("FIXED", "fixed")):
        marked = [k for k, h in cells.items() if getattr(h, mark)]
        if marked:
            what = "fail or error now, not in the build before" if mark == "new_failure" else \
                "pass now, failed or errored in the build before"
            print(f"\n{verb}: {len(marked)} cell(s) {what}: "
                  + ", ".join(f"{s}/{m}/{t}/seed{n}" for s, m, t, n, _ in marked))
    controls: dict[str, list[Any]] = {}
    for t in found:
        if t.control:
            controls.setdefault(t.cell_label, []).append(t)
    if controls:
        print(f"\npositive controls ({len(controls)}): runs with an injected fault, apart from the clean cells")
        for label, group in controls.items():
            by = [t.check for t in group if t.detected]
            status = f"still detected by {', '.join(by)}" if by else "NOT detected in its latest run"
            print(f"  {label}: {status} ({len(group[0].rows)} run(s))")
    flaky = [t for t in found if t.flaky]
    if flaky:
        print(f"\nFLAKY: {len(flaky)} check(s) flip between PASS and FAIL between runs of one build "
              "(a harness defect to fix):")
        for t in flaky:
            codes = sorted({f"commit {r.git_commit[:12]} engine {r.engine_version} build {r.build_label or '-'}"
                            for r in t.rows})
            print(f"  FLAKY {t.label}: {t.flips} flip(s) over {len(t.rows)} runs ({'; '.join(codes)})")
        return ExitCode.FAIL
    return ExitCode.OK
