"""The default matrix on the embedded engine, cold: wall and CPU seconds per suite and each cell's verdict.
Prints markdown; asserts nothing.

    python benchmarks/bench_default_matrix.py [--suites dcp tp gqa-odd spec] [--seeds 0 1] [--work DIR]
        [--json FILE] [--harness-python PY] [--pythonpath DIR]

Runs `harness run --suite S --topo all --seed 0 --seed 1 --out WORK/out-S --cache-dir WORK/cache` for each
suite in turn, all sharing one fresh cache (cold: every reference and noise run is launched). CPU seconds are
user + sys of each `harness run` and every process it waited for (`resource.getrusage(RUSAGE_CHILDREN)`), which
on a box shared with other jobs says more than wall time. `--harness-python` / `--pythonpath` run another
checkout's harness (to compare two versions interleaved, in the same conditions).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_suite(python: str, env: dict[str, str], suite: str, seeds: list[int], work: Path,
              cwd: str | None = None) -> dict[str, Any]:
    """One cold-or-warm `harness run --suite S --topo all` with the given seeds: wall, CPU, cells and verdicts.
    `cwd`: the folder it runs in (`python -m` puts it before PYTHONPATH on sys.path, so another checkout's harness
    runs only from that checkout)."""
    out = work / f"out-{suite}"
    argv = [python, "-m", "harness", "run", "--suite", suite, "--topo", "all", "--out", str(out),
            "--cache-dir", str(work / "cache")]
    for seed in seeds:
        argv += ["--seed", str(seed)]
    cpu0, wall0 = _cpu(), time.perf_counter()
    proc = subprocess.run(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          check=False)
    wall, cpu = time.perf_counter() - wall0, _cpu() - cpu0
    verdicts: dict[str, str] = {}
    results = out / "results.json"
    if results.is_file():
        for cell in json.loads(results.read_text())["cells"]:
            key = f"{cell['model']}|{cell['topology']}|{cell['seed']}|{cell.get('workload')}|{cell.get('fault')}"
            verdicts[key] = cell["status"]
    return {"suite": suite, "exit": proc.returncode, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
            "cells": len(verdicts), "statuses": dict(Counter(verdicts.values())), "verdicts": verdicts,
            "stderr_tail": proc.stderr[-2000:] if proc.returncode not in (0, 1) else ""}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suites", nargs="+", default=["dcp", "tp", "gqa-odd", "spec"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--work", default=None, help="folder for the reports and the cache (default: a new temp dir)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--harness-python", default=sys.executable)
    parser.add_argument("--pythonpath", default=None,
                        help="checkout whose harness runs, from that folder (default: this PYTHONPATH)")
    args = parser.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="default-matrix-")).resolve()
    if (work / "cache").exists():
        raise SystemExit(f"--work {work} already holds a cache: the matrix is measured cold, give a new folder")
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if args.pythonpath:
        env["PYTHONPATH"] = args.pythonpath
    rows = []
    print("| suite | exit | cells | statuses | wall s | CPU s |")
    print("| --- | --- | ---: | --- | ---: | ---: |")
    for suite in args.suites:
        row = run_suite(args.harness_python, env, suite, args.seeds, work, args.pythonpath)
        rows.append(row)
        statuses = ", ".join(f"{n} {s}" for s, n in sorted(row["statuses"].items()))
        print(f"| {suite} | {row['exit']} | {row['cells']} | {statuses} | {row['wall_s']} | {row['cpu_s']} |",
              flush=True)
        if row["stderr_tail"]:
            print(row["stderr_tail"], file=sys.stderr)
    total_wall = sum(r["wall_s"] for r in rows)
    total_cpu = sum(r["cpu_s"] for r in rows)
    print(f"| all | | {sum(r['cells'] for r in rows)} | | {total_wall:.1f} | {total_cpu:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"work": str(work), "rows": rows, "wall_s": total_wall,
                                               "cpu_s": total_cpu}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
