"""Cost of one launch of the embedded engine, torchrun against the fork launcher (harness/launcher/forkrun.py,
started warm from the forkserver of harness/launcher/forkserver.py), same job, interleaved rounds (one of
each per round, so load changes hit both alike), medians of --repeats. Prints wall seconds and the
machine's busy CPU seconds over the launch (from /proc/stat: a warm launch's processes are children of
the forkserver, not of this process, so their rusage never reaches it; run it on an idle machine) per
launch; asserts nothing.

    python benchmarks/bench_launch.py [--model tiny-gqa] [--topos tp2 tp4dcp2 tp8] [--repeats 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from harness.backends.embedded.backend import WORKER_MODULE
from harness.formats.locate import load_model
from harness.launcher.launch import LAUNCHER_ENV, LAUNCHERS, launch
from harness.records.contract import Job
from harness.specs.pool import PoolSettings
from harness.specs.topology import parse_topology_name

PROMPTS = ["The capital of France is", "def f(x):\n    return", "Q: 17 + 25 = ?\nA:"]


def machine_cpu() -> float:
    """Busy CPU seconds of the whole machine so far (/proc/stat: user, nice, system, irq, softirq, steal)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    busy = fields[0] + fields[1] + fields[2] + fields[5] + fields[6] + fields[7]
    return busy / os.sysconf("SC_CLK_TCK")


def one_launch(model: str, topo: str, launcher: str, out: Path) -> tuple[float, float]:
    """(wall s, CPU s) of one launch of the job with `launcher`."""
    job = Job(model=load_model(model), topology=parse_topology_name(topo), prompts=PROMPTS,
              out_dir=str(out), max_new_tokens=12, decode_prefix_tokens=3,
              pool=PoolSettings(budget_bytes=8 << 20, max_seq_len=256))
    cpu, start = machine_cpu(), time.perf_counter()
    result = launch(job, 900.0, WORKER_MODULE, env={LAUNCHER_ENV: launcher})
    if not result.ok:
        raise SystemExit(f"{launcher} {topo} failed: {result.error}")
    return time.perf_counter() - start, machine_cpu() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-gqa")
    parser.add_argument("--topos", nargs="+", default=["tp2", "tp4dcp2", "tp8"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    print(f"cores: {len(os.sched_getaffinity(0))}, load average: {os.getloadavg()[0]:.1f}")
    print("| topology | torchrun wall s | fork wall s | torchrun CPU s | fork CPU s | wall ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for topo in args.topos:
            got: dict[str, list[tuple[float, float]]] = {name: [] for name in LAUNCHERS}
            for r in range(args.repeats):
                for name in ("torchrun", "fork"):
                    got[name].append(one_launch(args.model, topo, name, Path(tmp) / f"{topo}-{name}-{r}"))
            med = {name: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
                   for name, v in got.items()}
            row = {"model": args.model, "topology": topo, "torchrun_wall_s": med["torchrun"][0],
                   "fork_wall_s": med["fork"][0], "torchrun_cpu_s": med["torchrun"][1], "fork_cpu_s": med["fork"][1]}
            rows.append(row)
            print(f"| {topo} | {row['torchrun_wall_s']:.2f} | {row['fork_wall_s']:.2f} | {row['torchrun_cpu_s']:.1f} "
                  f"| {row['fork_cpu_s']:.1f} | {row['torchrun_wall_s'] / row['fork_wall_s']:.2f}x |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
