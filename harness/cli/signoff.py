"""`harness signoff --candidate RUN_DIR... --baseline RUN_DIR... [--out DIR]`: the release sign-off page.

Compares a candidate build's run folders with the last signed-off build's: SIGN-OFF or BLOCKED at
the top (with the blocking cells), old vs new verdicts, metric deltas as multiples of noise, GSM8K
scores with the paired test and the minimum detectable drop, acceptance lengths, the cells whose reference
changed since its recording or whose recording carries an accepted numerics change (the candidate's references are
compared with baselines/references.yaml where its run had none to compare with), both builds'
provenance and every skipped or unavailable check. The first line counts the blocking cells by
category: new output corruption (silent or not), new performance-only, new ERROR (infrastructure:
PASS->ERROR is not a new FAIL), still failing, not run (a cell the candidate's run never reached). Every
cell counts, by its full identity (suite, model, topology, fault, seed, workload); a faulted candidate cell
is compared with the baseline's same cell without the fault. Writes signoff.html,
signoff.md and signoff.json (the same verdict, counts and cells for CI; keys in harness/signoff/render.py).
Exit 0 SIGN-OFF, 1 BLOCKED, 2 bad input: a candidate that is the same run as its baseline, or candidate and
baseline that do not cover the same cells (the cells that differ are named), included.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from harness.core.errors import ConfigError
from harness.core.paths import BASELINES_DIR, REPORTS_DIR
from harness.core.verdict import ExitCode


def add_parser(sub: Any) -> None:
    p = sub.add_parser("signoff", help="sign-off page: a candidate build's runs against the baseline build's",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--candidate", nargs="+", type=Path, required=True, metavar="RUN_DIR",
                   help="run folders of the candidate build")
    p.add_argument("--baseline", nargs="+", type=Path, required=True, metavar="RUN_DIR",
                   help="run folders of the last signed-off build")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: reports/signoff-<time>/)")
    p.add_argument("--baselines-dir", type=Path, default=BASELINES_DIR,
                   help="baselines folder: the candidate's references are compared with the recorded ones there "
                        "where its run had none to compare with")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from harness.baselines.reference_baseline import recheck
    from harness.cli.checks import require_writable_dir, writing_into
    from harness.signoff.compare import compare_builds, load_build, same_run
    from harness.signoff.render import header, write_signoff

    out = args.out or REPORTS_DIR / ("signoff-" + time.strftime("%Y%m%d-%H%M%S"))
    require_writable_dir(out, "--out")
    candidate, baseline = load_build(args.candidate, "candidate"), load_build(args.baseline, "baseline")
    where = str(args.candidate[0])
    candidate = replace(candidate, cells={k: recheck(c, args.baselines_dir, where) for k, c in candidate.cells.items()})
    why = same_run(candidate, baseline)
    if why:
        raise ConfigError(f"{why}: sign off a candidate against the last signed-off build's runs")
    signoff = compare_builds(candidate, baseline)
    with writing_into(out, "--out"):
        paths = write_signoff(out, signoff)
    head = header(signoff)
    print(f"{head.title}: {head.text}")
    for c in signoff.blocking:
        print(f"  blocking {c.label} ({c.change}): {c.reason}")
    print(f"sign-off page: {paths['html']} (markdown: {paths['markdown']}; for CI: {paths['json']})")
    return ExitCode.OK if signoff.signed_off else ExitCode.FAIL
