"""ParallelState: the one owner of process groups and of the launcher's environment.

Nothing else in the project reads RANK / WORLD_SIZE or calls torch.distributed. The model gets a
`Collectives` object from here; with world size 1 every collective is the identity, so the same
model code runs in-process without any process group.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from harness.errors import RunError
from harness.layout import dcp_members_of


@dataclass
class ParallelState:
    """This rank's place in the world: tp = world size; DCP groups are consecutive tp ranks."""

    rank: int
    tp: int
    dcp: int
    device: torch.device
    tp_group: Any = None
    dcp_group: Any = None

    @property
    def world_size(self) -> int:
        return self.tp

    @property
    def dcp_rank(self) -> int:
        return dcp_members_of(self.rank, self.dcp).index(self.rank)

    @property
    def distributed(self) -> bool:
        return self.tp > 1

    @classmethod
    def single(cls, device: str = "cpu") -> "ParallelState":
        return cls(rank=0, tp=1, dcp=1, device=torch.device(device))

    @classmethod
    def from_launcher(cls, tp: int, dcp: int, device: str, timeout_s: float) -> "ParallelState":
        """Join the process group torchrun set up (env:// rendezvous) and build the DCP groups."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        if world != tp:
            raise RunError(f"launched with WORLD_SIZE={world} but the topology needs tp={tp} ranks")
        if tp == 1:
            return cls.single(device)
        backend = "nccl" if device == "cuda" else "gloo"
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if device == "cuda" else torch.device("cpu")
        if device == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group(backend=backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        dcp_group = None
        for members in dict.fromkeys(dcp_members_of(r, dcp) for r in range(tp)):  # every rank creates every
            group = dist.new_group(list(members)) if dcp > 1 else None        # group, in the same order
            if rank in members:
                dcp_group = group
        return cls(rank=rank, tp=tp, dcp=dcp, device=dev, tp_group=dist.group.WORLD, dcp_group=dcp_group)

    def collectives(self) -> "Collectives":
        return Collectives(self)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (on every rank)."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.tp
        dist.all_gather_object(out, obj)
        return out

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class Collectives:
    """The collectives the model needs, over the groups ParallelState owns."""

    def __init__(self, state: ParallelState) -> None:
        self._state = state

    @property
    def dcp(self) -> int:
        return self._state.dcp

    @property
    def dcp_rank(self) -> int:
        return self._state.dcp_rank

    def reduce_tp(self, x: torch.Tensor) -> torch.Tensor:
        """Sum partial results of a row-parallel projection over the TP group."""
        if self._state.distributed:
            dist.all_reduce(x, group=self._state.tp_group)
        return x

    def gather_tp(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every TP rank's `x` along `dim`, in rank order."""
        return self._gather(x, dim, self._state.tp_group, self._state.tp if self._state.distributed else 1)

    def gather_dcp(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every DCP-group member's `x` along `dim`, in member order."""
        return self._gather(x, dim, self._state.dcp_group, self._state.dcp)

    def stack_dcp(self, x: torch.Tensor) -> torch.Tensor:
        """[dcp, *x.shape]: every DCP-group member's `x`, in member order."""
        return self.gather_dcp(x.unsqueeze(0), dim=0)

    @staticmethod
    def _gather(x: torch.Tensor, dim: int, group: Any, size: int) -> torch.Tensor:
        if size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)
