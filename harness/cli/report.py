"""`harness report DIR [DIR...] [--out OUT]`: re-render or merge run results without running anything.

One folder is re-rendered in place (or into --out); several are merged (a cell found in several
folders is taken from the folder given last) into --out, by default reports/<merged-run-id>/. Results
are never written over: an --out that holds another results.json (an input's included) is refused.
Exit code as for `harness run`: 0 all pass, 1 any FAIL, 3 any ERROR and no FAIL; 2 when a
results.json is missing, corrupt or of another schema version.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import Any

from harness.cli.checks import require_no_results, require_writable_dir, writing_into
from harness.core.folder_lock import hold_folder
from harness.core.paths import REPORTS_DIR
from harness.report import exit_code, merge, print_matrix, render_all


def add_parser(sub: Any) -> None:
    p = sub.add_parser("report", help="re-render or merge the results of run folders (no run)",
                       description=__doc__)
    p.add_argument("dirs", nargs="+", type=Path, metavar="DIR", help="run folders holding results.json")
    p.add_argument("--out", type=Path, default=None,
                   help="output folder (default: the folder itself for one DIR, reports/<run-id>/ for several)")
    p.add_argument("--history", type=Path, default=None,
                   help="history database: show each cell's recent runs and flaky/new-failure/fixed marks")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    dirs: list[Path] = args.dirs
    cells, provenance, run_id = merge(dirs)
    only = dirs[0] if dirs[0].is_dir() else dirs[0].parent
    out = args.out or (only if len(dirs) == 1 else REPORTS_DIR / run_id)
    require_writable_dir(out, "--out")
    if not (len(dirs) == 1 and out.resolve() == only.resolve()):  # re-rendering one folder in place is no overwrite
        require_no_results(out, "--out")
    histories = None
    if args.history is not None:
        from harness.records.history import histories_for
        histories = histories_for(args.history, cells)
    with writing_into(out, "--out"), hold_folder(out, shlex.join(["harness", *args.argv])):
        paths = render_all(out, cells, provenance, run_id, histories)
    print(print_matrix(cells))
    print(f"report: {paths['html']}")
    return exit_code(cells)
