"""Milliseconds per collective on the CPU: torch.distributed's own all_reduce / all_gather on gloo against
the engine's Collectives (harness/engine/runtime/parallel.py) on each of its paths: `shm`, shared memory among
the ranks of one machine (harness/engine/runtime/shm_group.py, the default, headers checked), and `gloo`
(HARNESS_SHM_COLLECTIVES=0: a gather at the group's first member, for an all-reduce a member-order sum there, and
one broadcast, on gloo), per world size and
message size, ranks forked by the fork launcher. Prints numbers; asserts nothing.

    python benchmarks/bench_collectives.py [--worlds 2 4 8] [--kib 0.25 16 256 4096] [--repeats 100]
        [--paths shm gloo]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

PATHS = {"shm": "1", "gloo": "0"}  # engine path -> HARNESS_SHM_COLLECTIVES


def _ms(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(5):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return 1000 * (time.perf_counter() - start) / repeats


def main(argv: list[str]) -> int:
    """One rank (run by the fork launcher): time each collective, rank 0 prints a row per size."""
    import torch
    import torch.distributed as dist

    from harness.engine.runtime.parallel import ParallelState

    worlds_kib, repeats, path = [float(k) for k in argv[0].split(",")], int(argv[1]), argv[2]
    world = int(os.environ["WORLD_SIZE"])
    state = ParallelState.from_launcher(world, 1, "cpu", 300)
    comm = state.collectives()
    for kib in worlds_kib:
        x = torch.ones(max(1, int(kib * 256)))  # float32: 256 per KiB
        n = max(3, int(repeats * min(1.0, 64 / max(kib, 1))))
        parts = [torch.empty_like(x) for _ in range(world)]
        row = {"all_reduce": _ms(lambda: dist.all_reduce(x), n), "engine reduce": _ms(lambda: comm.reduce_tp(x), n),
               "all_gather": _ms(lambda: dist.all_gather(parts, x), n),
               "engine gather": _ms(lambda: comm.gather_tp(x, 0), n)}
        if state.rank == 0:
            print(f"| {world} | {kib:g} | {path} | " + " | ".join(f"{v:.3f}" for v in row.values()) + " |", flush=True)
    state.shutdown()
    return 0


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", nargs="+", type=int, default=[2, 4, 8])
    parser.add_argument("--kib", nargs="+", type=float, default=[0.25, 16, 256, 4096])
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    args = parser.parse_args()
    print("| ranks | KiB per rank | engine path | gloo all_reduce ms | engine reduce_tp ms | gloo all_gather ms "
          "| engine gather_tp ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    for world in args.worlds:
        for path in args.paths:
            subprocess.run([sys.executable, "-m", "harness.launcher.forkrun", f"--nproc={world}",
                            "--module=bench_collectives", "--", ",".join(str(k) for k in args.kib),
                            str(args.repeats), path], env={**env, "HARNESS_SHM_COLLECTIVES": PATHS[path]}, check=True)


if __name__ == "__main__":
    cli()
