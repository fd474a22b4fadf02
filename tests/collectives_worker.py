"""A rank of tests/test_parallel_collectives.py, run by the fork launcher: the engine's collectives
(harness/engine/runtime/parallel.py) on fixed inputs, written to OUT/rank{r}.safetensors, with `shm` = 1 when the
run's collectives went through shared memory. Argument `hang` instead makes the last rank skip the first
all-reduce (it sleeps, then exits); `mismatch KIND` makes rank ODD_RANK (DCP: the last rank) bring another
collective than the others after a few matching ones (KIND: op, size, dtype, dcp; `same`: no odd one), and
every rank writes what its collective did (ok or the RunError's message) and how long it took to
OUT/rank{r}.json."""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from safetensors.torch import save_file

from harness.core.errors import RunError
from harness.engine.runtime.parallel import Collectives, ParallelState
from harness.engine.runtime.shm_group import SLOT_BYTES

SIZES = ("small", "large")  # within one shared-memory slot and over it (two pieces)
HANG_TIMEOUT_S = 2.0
MISMATCH_TIMEOUT_S = 120.0  # a mismatch must fail long before this
MISMATCHES = ("same", "op", "size", "dtype", "dcp")
ODD_RANK = 1
MATCHED = 256  # float32 elements of every matching collective
LARGE = SLOT_BYTES // 4 + 7  # float32 elements: two pieces


def elements(size: str, dtype: torch.dtype) -> int:
    return 96 if size == "small" else SLOT_BYTES // dtype.itemsize + 7


def mismatched(state: ParallelState, comm: Collectives, kind: str) -> None:
    """Collectives every rank brings alike, then the one rank ODD_RANK (dcp: the last rank) brings otherwise."""
    x = torch.ones(MATCHED)
    comm.reduce_tp(x.clone())
    comm.gather_tp(x, dim=0)
    comm.gather_dcp(x, dim=0)
    if kind == "dcp":  # the last DCP group's second member: a 2-member group, a tie broken by member order
        comm.gather_dcp(x.to(torch.bfloat16) if state.rank == state.tp - 1 else x, dim=0)
    elif kind == "same" or state.rank != ODD_RANK:
        comm.reduce_tp(x.clone())
    elif kind == "op":
        comm.gather_tp(x, dim=0)
    elif kind == "size":
        comm.reduce_tp(torch.ones(LARGE))
    else:
        comm.reduce_tp(x.to(torch.bfloat16))


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
    if argv[2:3] == ["mismatch"]:
        state = ParallelState.from_launcher(world, dcp, "cpu", MISMATCH_TIMEOUT_S)
        start = time.monotonic()
        try:
            mismatched(state, state.collectives(), argv[3])
            result = "ok"
        except RunError as exc:  # caught: the launcher would stop the other ranks at the first failure
            result = f"RunError: {exc}"
        with open(os.path.join(out, f"rank{state.rank}.json"), "w") as f:
            json.dump({"result": result, "seconds": time.monotonic() - start, "shm": bool(state.shm)}, f)
        state.shutdown()
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
            tensors[f"{key}.reduce_2d_t"] = comm.reduce_tp(x.clone()[: n - n % 2].view(2, -1).t())  # non-contiguous
            tensors[f"{key}.gather"] = comm.gather_tp(x.view(1, -1), dim=0)  # [world, n]
            tensors[f"{key}.gather_dcp"] = comm.gather_dcp(x.view(1, -1), dim=0)  # [dcp, n]
            tensors[f"{key}.gather_dcp_2d"] = comm.gather_dcp(x.view(-1, 1)[: n - n % 2].view(2, -1), dim=1)
    save_file({k: v.contiguous().clone() for k, v in tensors.items()},
              os.path.join(out, f"rank{state.rank}.safetensors"))
    state.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
