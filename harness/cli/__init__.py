"""The thin command line: one module per subcommand; only this package exits."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from types import ModuleType

from harness import __version__
from harness.core.errors import ConfigError, HarnessError
from harness.core.verdict import ExitCode


def _subcommands() -> list[ModuleType]:
    from harness.cli import (
        baseline,
        bisect,
        cache,
        export,
        history,
        list_cmd,
        matrix,
        report,
        run,
        serve,
        signoff,
        validate,
    )
    from harness.cli.plan import command as plan
    return [plan, list_cmd, run, matrix, report, baseline, cache, history, bisect, signoff, validate, export, serve]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        print(f"harness: error: {message}", file=sys.stderr)
        raise SystemExit(ExitCode.USAGE)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="harness", description="Multi-GPU correctness and accuracy regression harness.")
    parser.add_argument("--version", action="version", version=f"harness {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for mod in _subcommands():
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command, for provenance
    try:
        code = int(args.func(args))
        sys.stdout.flush()  # a closed pipe shows up here at the latest
        return code
    except BrokenPipeError:  # `harness plan --format json | head`: the reader is gone; exit quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return ExitCode.BROKEN_PIPE
    except ConfigError as exc:
        print(f"harness: error: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    except HarnessError as exc:
        print(f"harness: error: {exc}", file=sys.stderr)
        return ExitCode.ERROR
    except Exception:  # a harness bug must not read as a FAIL (exit 1) to CI
        traceback.print_exc()
        print("harness: internal error (a bug in the harness; traceback above)", file=sys.stderr)
        return ExitCode.ERROR
