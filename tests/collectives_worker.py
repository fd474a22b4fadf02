"""A rank of tests/test_parallel_collectives.py, run by the fork launcher: the engine's collectives
(harness/engine/parallel.py) next to torch.distributed's own on the same inputs, written to
OUT/rank{r}.safetensors, with `shm` = 1 when the run's collectives went through shared memory.
Argument `hang` instead makes the last rank skip the first all-reduce (it sleeps, then exits)."""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from harness.engine.parallel import STAR_MAX_BYTES, ParallelState

SIZES = ("small", "large")  # under and over the star path's message limit (and a shared-memory slot)
HANG_TIMEOUT_S = 2.0


def elements(size: str, dtype: torch.dtype) -> int:
    return 96 if size == "small" else STAR_MAX_BYTES // dtype.itemsize + 7


def main(argv: list[str]) -> int:
    out, dcp = argv[0], int(argv[1])
    world = int(os.environ["WORLD_SIZE"])
    if argv[2:] == ["hang"]:
        state = ParallelState.from_launcher(world, dcp, "cpu", HANG_TIMEOUT_S)
        if state.rank == world - 1:
            time.sleep(30)
            return 0
        state.collectives().reduce_tp(torch.ones(4))
        return 0
    state = ParallelState.from_launcher(world, dcp, "cpu", 120)
    comm = state.collectives()
    tensors: dict[str, torch.Tensor] = {"shm": torch.tensor([1 if state.shm else 0])}
    for dtype in (torch.float32, torch.bfloat16):
        for name in SIZES:
            n = elements(name, dtype)
            x = torch.randn(n, generator=torch.Generator().manual_seed(1000 * state.rank + n)).to(dtype)
            key = f"{name}.{str(dtype).removeprefix('torch.')}"
            tensors[f"{key}.input"] = x.clone()
            tensors[f"{key}.reduce"] = comm.reduce_tp(x.clone())
            ring = x.clone()
            dist.all_reduce(ring)
            tensors[f"{key}.ring"] = ring
            tensors[f"{key}.gather"] = comm.gather_tp(x.view(1, -1), dim=0)  # [world, n]
            tensors[f"{key}.gather_dcp"] = comm.gather_dcp(x.view(1, -1), dim=0)  # [dcp, n]
            tensors[f"{key}.gather_dcp_2d"] = comm.gather_dcp(x.view(-1, 1)[: n - n % 2].view(2, -1), dim=1)
    save_file({k: v.contiguous().clone() for k, v in tensors.items()},
              os.path.join(out, f"rank{state.rank}.safetensors"))
    state.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
