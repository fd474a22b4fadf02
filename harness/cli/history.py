"""`harness history add RUN_DIR... | show | cell CELL`: record finished runs into the history store, show trends,
and answer on-call's questions about one cell.

The store is one SQLite file: --history PATH, else $HARNESS_HISTORY. `show` prints one line per
cell x check (verdicts of its runs, oldest first: P pass, W warn, F fail, E error, S skip), its
latest key metric and noise multiple, and the marks NEW-FAIL, FIXED and FLAKY (PASS<->FAIL flips
between runs of one build: a harness defect, listed again at the end). A run with an injected fault is
a positive control: its lines are apart from the clean cell's ([fault NAME]), never a flip or a new
failure, and are summed up as "still detected" or "NOT detected". Exit 0; 1 when a check is flaky.

`cell CELL --window 60d` prints, per matching cell: whether it fails now and since which run and build (the
streak's start), its first failure in the window, how many times it flipped between passing and failing, its
last good run and build, the builds from there to the streak's start, and the `harness bisect` command over
that range (records/history.py: cell_stories).
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
    cell = hsub.add_parser("cell", help="what on-call asks of a cell: failing since, first failure in the window, "
                           "flips, last good build and the builds since")
    cell.add_argument("cell_pattern", metavar="CELL",
                      help="the cell (a cell id of harness matrix, topology, model/topology, or part of "
                           "suite/model/topology/seedN)")
    cell.add_argument("--window", default="60d", help="how far back (an age: 60d, 12h, 2w; or an ISO date; "
                      "default 60d)")
    cell.add_argument("--format", choices=("text", "json"), default="text")
    for sp in (add, show, cell):
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
            return show(conn, args) if args.history_command == "show" else on_call(conn, args)
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


def _pattern(text: str) -> str:
    """A cell id of `harness matrix` (suite/model/topology[+fault]/seedN/workload) as the store's cell name
    (suite/model/topology[/workload]/seedN); any other pattern as it is."""
    parts = text.split("/")
    if len(parts) == 5 and parts[3].startswith("seed"):
        suite, model, topo, seed, workload = parts
        topo = topo.split("+", 1)[0]
        return f"{suite}/{model}/{topo}{'' if workload == 'prompts' else '/' + workload}/{seed}"
    return text


def on_call(conn: Any, args: argparse.Namespace) -> int:
    """`harness history cell CELL`: per matching cell (and fault), its story over the window."""
    import json

    from harness.records.history import cell_stories, parse_since, query
    since = parse_since(args.window)
    pattern = _pattern(args.cell_pattern)
    wanted_fault = args.cell_pattern.split("/")[2].split("+", 1)[1] if "+" in args.cell_pattern else None
    rows = [r for r in query(conn, None, [pattern], since)
            if pattern.count("/") < 3 or f"{r.suite}/{r.model}/{r.topology}/seed{r.seed}" == pattern]
    stories = [s for s in cell_stories(rows) if wanted_fault is None or s.key[4] == wanted_fault]
    if not stories:
        print(f"no recorded runs of {args.cell_pattern} since {since}")
        return ExitCode.OK
    if args.format == "json":
        print(json.dumps([s.to_dict() for s in stories], indent=2))
        return ExitCode.OK
    for s in stories:
        print(f"{s.label}: {len(s.runs)} run(s) since {since}, "
              + ("FAILING" if s.failing else f"passing ({s.runs[-1].status} in {s.runs[-1].run_id})"))
        if s.failing:
            start = s.streak[0]
            print(f"  failing since      {start.created}  run {start.run_id}  build {start.build} "
                  f"({len(s.streak)} run(s) in a row)")
        first = s.first_failure
        print("  first failure      " + (f"{first.created}  run {first.run_id}  build {first.build}" if first
                                         else "none in the window"))
        print(f"  flips              {s.flips} (pass <-> fail between consecutive runs)")
        good = s.last_good
        print("  last good          " + (f"{good.created}  run {good.run_id}  build {good.build}" if good
                                         else "none in the window"))
        if s.failing:
            print("  builds since good  " + ", ".join(f"{r.build} ({r.status})" for r in s.between))
            if good is not None and good.git_commit and s.streak[0].git_commit and \
                    good.git_commit != s.streak[0].git_commit:
                print(f"  bisect with        harness bisect --cell ID --good {good.git_commit[:12]} "
                      f"--bad {s.streak[0].git_commit[:12]}")
    return ExitCode.OK
