"""Detection table: for every fault in the catalog, which default suite run flags it, and the
false-positive rate of the clean default suites over seeds. Prints markdown; asserts nothing.

    python benchmarks/bench_faults.py [--faults a,b] [--suites tp,dcp,...,hybrid:tiny-hybrid-bf16]
                                      [--clean-seeds 0,1,2,3,4] [--no-faults] [--no-clean]
                                      [--cache-dir DIR] [--work DIR] [--json FILE]

Each fault is run as a user would: `harness run --suite S --topo all --fault F`, trying the default
suites in order (only those whose topologies can express the fault: a speculator fault only `spec`,
a DCP fault only suites with DCP cells) until one flags it (exit 1); an entry SUITE:MODEL runs the suite
with `--model MODEL`. A suite where the fault is inert
in every cell answers exit 2 and the next one is tried. The clean part runs `harness run --suite S
--topo all --seed N` for every suite and seed and counts the cells that are neither PASS nor SKIP
(must be 0; a SKIP is a model that cannot split at that topology).
Every run shares one reference cache (--cache-dir), so each (model, seed) reference and noise run is
paid once. Rows are printed as they finish and the JSON file is rewritten after each run, so an
interrupted run still leaves its measured rows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# an entry SUITE:MODEL runs the suite with --model MODEL (a shipped model no suite runs by default)
DEFAULT_SUITES: tuple[str, ...] = ("tp", "dcp", "gqa-odd", "spec", "hybrid", "mla", "moe-dp", "dsa", "pd",
                                   "hybrid:tiny-hybrid-bf16")


@dataclass
class SuiteRun:
    """One `harness run --suite S --topo all [--fault F] [--seed N]` and what it found."""

    suite: str
    fault: str | None
    seed: int | None
    rc: int
    seconds: float
    cells: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    silent: int = 0
    localization: str = ""
    note: str = ""

    @property
    def flagged(self) -> bool:
        return self.rc == 1 and self.silent > 0


def candidate_suites(fault: str, suites: tuple[str, ...]) -> list[str]:
    """The suites whose topologies can express `fault` (its needs against the suite's topology set)."""
    from harness.checks.settings import load_suite
    from harness.engine.faults import FAULTS
    from harness.specs.topology import load_catalog

    need = FAULTS[fault]
    catalog = load_catalog()
    out = []
    for name in suites:
        suite = load_suite(name.split(":")[0])
        topologies = catalog.resolve(",".join(suite.topologies), all_names=suite.topologies)
        if any((not need.needs_dcp or t.dcp > 1) and (not need.needs_tp or t.tp > 1)
               and (not need.needs_speculator
                    or (t.speculator != "none" and need.needs_speculator in ("any", t.speculator)))
               and (not need.needs_placement or (t.placement.kind == need.needs_placement and (
                   need.needs_placement != "interleave" or t.placement.size > 1)))
               and (not need.needs_q_replicated or t.q_replicated)
               and (not need.needs_pd or t.prefill is not None)
               for t in topologies):
            out.append(name)
    return out


def run_suite(suite: str, fault: str | None, seed: int | None, cache_dir: Path, work: Path) -> SuiteRun:
    """Run one suite over all its topologies in a fresh process; read results.json."""
    name, _, model = suite.partition(":")
    tag = f"{suite.replace(':', '-')}-{fault or 'clean'}" + ("" if seed is None else f"-seed{seed}")
    out = work / tag
    argv = [sys.executable, "-m", "harness", "run", "--suite", name, "--topo", "all", "--out", str(out),
            "--cache-dir", str(cache_dir)]
    argv += ["--model", model] if model else []
    argv += ["--fault", fault] if fault else []
    argv += ["--seed", str(seed)] if seed is not None else []
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env={**os.environ})
    run = SuiteRun(suite=suite, fault=fault, seed=seed, rc=proc.returncode, seconds=time.perf_counter() - start)
    results = out / "results.json"
    if not results.is_file():
        run.note = (proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or [""])[-1][:200]
        return run
    cells = json.loads(results.read_text())["cells"]
    run.cells = len(cells)
    for cell in cells:
        run.statuses[cell["status"]] = run.statuses.get(cell["status"], 0) + 1
    run.silent = sum(bool(cell["silent_corruption"]) for cell in cells)
    first = next((c for c in cells if c["silent_corruption"] and c.get("localization")), None)
    if first is not None:
        run.localization = f"{first['model']} {first['topology']}: {first['localization'].get('summary', '')}"[:220]
    return run


def _cells(run: SuiteRun) -> str:
    parts = ", ".join(f"{n} {s}" for s, n in sorted(run.statuses.items()))
    return f"{run.cells} ({parts})" if run.cells else "-"


def fault_row(fault: str, runs: list[SuiteRun]) -> str:
    flagged = next((r for r in runs if r.flagged), None)
    tried = ", ".join(f"{r.suite} rc {r.rc}" for r in runs) or "no suite can express it"
    if flagged is None:
        return f"| {fault} | not flagged | tried: {tried} | - | {sum(r.seconds for r in runs):.0f} | - |"
    return (f"| {fault} | {flagged.suite} | FAIL, exit 1, {flagged.silent} silent-corruption cell(s) | "
            f"{_cells(flagged)} | {flagged.seconds:.0f} | {flagged.localization or '-'} |")


def flagged_cells(run: SuiteRun) -> int:
    """Clean cells that are neither PASS nor SKIP (a SKIP is a layout the model cannot split)."""
    return run.cells - run.statuses.get("PASS", 0) - run.statuses.get("SKIP", 0)


def clean_row(run: SuiteRun) -> str:
    return (f"| {run.suite} | {run.seed} | exit {run.rc} | {_cells(run)} | {flagged_cells(run)} | {run.seconds:.0f} |"
            + (f" {run.note}" if run.note else ""))


def _load() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--faults", default="", help="comma list (default: every fault in the catalog)")
    p.add_argument("--suites", default=",".join(DEFAULT_SUITES), help="default suites, tried in this order")
    p.add_argument("--clean-seeds", default="0,1,2,3,4", help="seeds of the clean false-positive runs")
    p.add_argument("--no-faults", action="store_true", help="skip the per-fault table")
    p.add_argument("--no-clean", action="store_true", help="skip the clean false-positive runs")
    p.add_argument("--cache-dir", type=Path, default=Path("reports/bench-faults/cache"))
    p.add_argument("--work", type=Path, default=Path("reports/bench-faults/runs"))
    p.add_argument("--json", type=Path, default=None, help="write every run as JSON (rewritten after each run)")
    args = p.parse_args()
    from harness.engine.faults import FAULTS

    suites = tuple(s for s in args.suites.split(",") if s)
    faults = [f for f in args.faults.split(",") if f] or list(FAULTS)
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        print(f"unknown fault(s) {', '.join(unknown)}; valid: {', '.join(FAULTS)}", file=sys.stderr)
        return 2
    record: dict[str, Any] = {"load_at_start": _load(), "faults": {}, "clean": []}

    def save() -> None:
        if args.json:
            args.json.write_text(json.dumps(record, indent=1))

    fault_lines, clean_lines = [], []
    if not args.no_faults:
        for fault in faults:
            runs: list[SuiteRun] = []
            for suite in candidate_suites(fault, suites):
                runs.append(run_suite(suite, fault, None, args.cache_dir, args.work))
                print(f"  {fault} on {suite}: exit {runs[-1].rc}, {_cells(runs[-1])}, {runs[-1].seconds:.0f} s "
                      f"(load {_load()})", file=sys.stderr, flush=True)
                record["faults"][fault] = [asdict(r) for r in runs]
                save()
                if runs[-1].flagged:
                    break
            fault_lines.append(fault_row(fault, runs))
            print(fault_lines[-1], flush=True)
    if not args.no_clean:
        for seed in (int(s) for s in args.clean_seeds.split(",") if s):
            for suite in suites:
                run = run_suite(suite, None, seed, args.cache_dir, args.work)
                record["clean"].append(asdict(run))
                save()
                clean_lines.append(clean_row(run))
                print(clean_lines[-1], flush=True)
    record["load_at_end"] = _load()
    save()
    if fault_lines:
        print("\n| fault | flagged by (`--suite S --topo all`) | verdict | cells | seconds | first localization |")
        print("| --- | --- | --- | --- | --- | --- |")
        print("\n".join(fault_lines))
    if clean_lines:
        total = sum(r["cells"] - r["statuses"].get("SKIP", 0) for r in record["clean"])
        bad = sum(flagged_cells(SuiteRun(**r)) for r in record["clean"])
        print("\n| suite (clean) | seed | exit | cells | flagged (not PASS, not SKIP) | seconds |")
        print("| --- | --- | --- | --- | --- | --- |")
        print("\n".join(clean_lines))
        print(f"\nfalse positives: {bad} of {total} clean cells that ran")
    print(f"\nload average at start {record['load_at_start']}, at end {record['load_at_end']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
