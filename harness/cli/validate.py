"""`harness validate RUN_DIR...`: check run folders against the artifacts contract (exit 0/1)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from harness.core.errors import ConfigError
from harness.core.verdict import ExitCode


def add_parser(sub: Any) -> None:
    p = sub.add_parser("validate", help="check run folders against the artifacts contract (for backend authors)")
    p.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR",
                   help="a run folder (manifest.json, cases.json, tensors.safetensors, layout.json)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from harness.records.validate import validate_run

    for run_dir in args.run_dirs:  # a mistyped path is bad input, not an invalid run
        if not run_dir.exists():
            raise ConfigError(f"RUN_DIR {run_dir} does not exist; give a run folder (one holding manifest.json)")
        if not run_dir.is_dir():
            raise ConfigError(f"RUN_DIR {run_dir} is a file, not a folder; give a run folder (one holding "
                              f"manifest.json)")
    bad = 0
    for run_dir in args.run_dirs:
        problems = validate_run(run_dir)
        if problems:
            bad += 1
            print(f"{run_dir}: INVALID ({len(problems)} problem{'s' if len(problems) > 1 else ''})")
            print("\n".join(f"  - {p}" for p in problems))
        else:
            print(f"{run_dir}: ok")
    return ExitCode.FAIL if bad else ExitCode.OK
