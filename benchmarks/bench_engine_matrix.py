"""Where a matrix on an HTTP engine spends its time: server starts, and per cell the time in server starts,
in requests and in the harness's own work, from what the run records. Prints markdown; asserts nothing.

    python benchmarks/bench_engine_matrix.py [HARNESS RUN ARGUMENTS...]
    python benchmarks/bench_engine_matrix.py --suite tp --engine vllm --model tiny-hd64 --topo tp2,tp4 \\
        --seed 0 --seed 1 --max-seq-len 256 --workload prompts,concurrent

The arguments are `harness run`'s (add --server-per-run to measure a server per run). The matrix runs in this
process; each run it launches (a cell's, a reference's, a noise twin's) is charged to the cell during which it
ran (the runner resolves a cell's references before its own run). Per run the manifest records its wall time and
its servers (harness/backends/http/pool.py: started or reused, seconds to ready): a started server's seconds to
ready are "start", the rest of the run's wall time is "requests", and what is left of the cell's wall time
(references looked up, checks, the report's inputs) is "harness".
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from harness.cli import build_parser
from harness.cli.run import build_request
from harness.core.errors import RunError
from harness.core.jsonio import read_json
from harness.core.paths import cache_dir_given
from harness.flow.runner import Runner


def _servers(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """The servers a run's manifest records: its plain server, and a -draft / -mtp run's speculative one."""
    plain = manifest.get("server") or {}
    spec = plain.get("speculative")
    return [s for s in (plain, spec) if s]


def split(run_dirs: list[str]) -> dict[str, float]:
    """start / requests / runs seconds of the runs in `run_dirs`, from their manifests."""
    out = {"start": 0.0, "requests": 0.0, "runs": 0.0}
    for folder in dict.fromkeys(run_dirs):  # a -draft run leases two servers into one folder
        try:
            manifest = read_json(Path(folder) / "manifest.json")
        except RunError:  # a run without a manifest (killed mid-write): nothing recorded to charge
            continue
        total = float((manifest.get("wall_s") or {}).get("total", 0.0))
        servers = _servers(manifest)
        start = sum(float(s.get("ready_s") or 0.0) for s in servers if s.get("started"))
        ready = sum(float(s.get("ready_s") or 0.0) for s in servers)
        out["start"] += start
        out["requests"] += max(0.0, total - ready)
        out["runs"] += total
    return out


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(["run", *argv])
    args.argv = ["run", *argv]
    with cache_dir_given(args.cache_dir):
        marks: list[tuple[float, str, int]] = []  # (time, cell slug, leases so far) at each cell's start

        def progress(line: str) -> None:
            print(line, flush=True)
            if line.startswith("[") and line.endswith(" ..."):
                marks.append((time.monotonic(), line.split("] ", 1)[1][:-4], len(runner.servers.leases)))

        runner = Runner(build_request(args), progress=progress)
        runner.run()
        end = time.monotonic()
    leases = runner.servers.leases
    print(f"\nserver starts: {runner.servers.started} for {len(leases)} leases (runs' servers: a -draft run leases "
          f"two) over {len(marks)} cells\n")
    print("| cell | wall s | server start s | requests s | harness s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    totals = {"wall": 0.0, "start": 0.0, "requests": 0.0, "harness": 0.0}
    for n, (t0, slug, first) in enumerate(marks):
        t1, last = (marks[n + 1][0], marks[n + 1][2]) if n + 1 < len(marks) else (end, len(leases))
        got = split(leases[first:last])  # the runs leased while this cell ran: its own and its references'
        row = {"wall": t1 - t0, "start": got["start"], "requests": got["requests"],
               "harness": max(0.0, (t1 - t0) - got["runs"])}
        for k in totals:
            totals[k] += row[k]
        print(f"| {slug} | {row['wall']:.1f} | {row['start']:.1f} | {row['requests']:.1f} | {row['harness']:.1f} |")
    print(f"| total | {totals['wall']:.1f} | {totals['start']:.1f} | {totals['requests']:.1f} | "
          f"{totals['harness']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
