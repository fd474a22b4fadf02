"""`harness matrix`: the cells of a run as JSON lines, for a scheduler (Slurm, Kubernetes, a CI system).

Takes the arguments of `harness run` and prints one line per cell (harness/records/cells.py: its id, identity,
GPUs and nodes, the server configuration and reference it shares, estimated seconds and their source, the command
that runs it alone) without running anything. `--history` estimates by the launch times recorded there.
`harness run --cells-from FILE --shard env` then runs one share of those lines.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from harness.cli.checks import positive_int
from harness.cli.run import add_run_arguments, build_request, select_cells
from harness.core.verdict import ExitCode


def add_parser(sub: Any) -> None:
    p = sub.add_parser("matrix", help="print every cell of a run as JSON lines (for a scheduler)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(p)
    p.add_argument("--gpus-per-node", type=positive_int, default=8,
                   help="GPUs of one machine, for each cell's node count (default 8)")
    p.add_argument("--summary", action="store_true",
                   help="also print a summary line on stderr (cells, launches, cells per GPU count, estimate)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from harness.flow.matrix import matrix_cells
    from harness.flow.runner import Runner
    from harness.records.cells import summary
    from harness.records.history import history_path

    req = select_cells(build_request(args), args.cells, args.cells_from)
    cells = matrix_cells(Runner(req, progress=lambda _: None), history_path(args.history), args.gpus_per_node)
    for cell in cells:
        print(cell.to_json())
    if args.summary:
        print(json.dumps(summary(cells)), file=sys.stderr)
    return ExitCode.OK
