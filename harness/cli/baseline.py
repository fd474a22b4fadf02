"""`harness baseline`: record GSM8K baselines from a run (diff first), or show them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from harness.jsonio import read_json
from harness.baseline import (BASELINES_DIR, Baselines, BaselineEntry, baselines_path, diff_lines,
                              entry_from_cell, load_baselines, skip_reason, write_baselines)
from harness.errors import ConfigError
from harness.fmt import table
from harness.report.results import RESULTS_FILE, read_results
from harness.verdict import CellResult


def add_parser(sub: Any) -> None:
    p = sub.add_parser("baseline", help="record or show GSM8K baselines (baselines/<suite>.yaml)")
    actions = p.add_subparsers(dest="baseline_action", required=True)
    up = actions.add_parser("update", help="write baselines from a run's results.json, showing the diff first")
    up.add_argument("--from", dest="run_dir", required=True, help="run folder holding results.json (or the file)")
    up.add_argument("--suite", default=None, help="only this suite's cells (needed when the run holds several)")
    up.add_argument("--yes", action="store_true", help="write without asking")
    up.add_argument("--dir", dest="folder", type=Path, default=BASELINES_DIR, help="baselines folder")
    up.set_defaults(func=run)
    show = actions.add_parser("show", help="print a suite's baselines")
    show.add_argument("--suite", required=True)
    show.add_argument("--dir", dest="folder", type=Path, default=BASELINES_DIR, help="baselines folder")
    show.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.baseline_action == "show":
        return _show(load_baselines(args.suite, args.folder))
    return _update(Path(args.run_dir), args.suite, args.yes, args.folder)


def _show(baselines: Baselines) -> int:
    if not baselines.entries:
        print(f"no baselines for suite {baselines.suite!r}")
        return 0
    rows = [[e.model, e.task, e.topology, str(e.n), f"{e.score:.4f}", f"{e.stderr:.4f}", e.filter,
             str(e.provenance.get("git_commit", ""))[:12], str(e.provenance.get("date", ""))]
            for e in baselines.entries]
    print(table(["model", "task", "topology", "n", "score", "stderr", "filter", "commit", "date"], rows))
    return 0


def _suite_of(cells: list[CellResult], suite: str | None) -> str:
    suites = sorted({c.suite for c in cells})
    if suite is not None:
        if suite not in suites:
            raise ConfigError(f"--suite {suite!r}: the run holds suites {', '.join(suites) or 'none'}")
        return suite
    if len(suites) != 1:
        raise ConfigError(f"the run holds suites {', '.join(suites) or 'none'}; pick one with --suite")
    return suites[0]


def _entries(cells: list[CellResult], provenance: dict[str, Any], run_id: str,
             created: str) -> list[BaselineEntry]:
    entries: list[BaselineEntry] = []
    for cell in cells:
        reason = skip_reason(cell)
        if reason is not None:
            print(f"skip {cell.model} / {cell.topology} (seed {cell.seed}): {reason}")
            continue
        entry = entry_from_cell(cell, provenance, run_id, created)
        if any(e.key == entry.key for e in entries):
            raise ConfigError(f"two cells of the run give {entry.label} (seeds or repeats); "
                              f"record baselines from a run with one cell per model, task, topology and n")
        entries.append(entry)
    return entries


def _update(run_dir: Path, suite_arg: str | None, yes: bool, folder: Path) -> int:
    all_cells, provenance, run_id = read_results(run_dir)
    suite = _suite_of(all_cells, suite_arg)
    results_path = run_dir if run_dir.is_file() else run_dir / RESULTS_FILE
    created = str(read_json(results_path).get("created", ""))
    entries = _entries([c for c in all_cells if c.suite == suite], provenance, run_id, created)
    path = baselines_path(suite, folder)
    old = load_baselines(suite, folder)
    if not entries:
        print(f"{run_dir}: no cell of suite {suite!r} holds a GSM8K score to record")
        return 1
    lines, changed = diff_lines(old, entries)
    print(f"{path} (suite {suite}):")
    print("\n".join(lines))
    if changed == 0:
        print("baselines are up to date; nothing to write")
        return 0
    if not yes:
        if not sys.stdin.isatty():
            print(f"not a terminal: pass --yes to write these {changed} change(s)", file=sys.stderr)
            return 1
        if input(f"write {changed} change(s) to {path}? [y/N] ").strip().lower() not in ("y", "yes"):
            print("nothing written")
            return 1
    write_baselines(old.merged(entries), path)
    print(f"wrote {changed} change(s) to {path}")
    return 0
