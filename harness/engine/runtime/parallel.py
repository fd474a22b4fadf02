"""ParallelState: the one owner of process groups and of the launcher's environment.

Nothing else in the project reads RANK / WORLD_SIZE or calls torch.distributed. The model gets a
`Collectives` object from here; with world size 1 every collective is the identity, so the same
model code runs in-process without any process group.
"""

from __future__ import annotations

import datetime
import os
import secrets
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist

from harness.core.errors import RunError
from harness.engine.runtime import shm_group
from harness.engine.runtime.shm_group import ShmGroup
from harness.partition.layout import dcp_members_of

# Ranks of one machine exchange tensors through shared memory (harness/engine/runtime/shm_group.py: 0.06-0.6 ms per
# collective at 2-8 ranks on a 2-core machine), which also checks that every member brought the same collective.
# Where that is off or impossible (several nodes, another platform) gloo serves through a star: a gather at the
# group's first member (which, for an all-reduce, sums in member order: the arithmetic of shared memory, so both
# paths are bit-identical; gloo's own all_reduce adds in another order) and one broadcast. At 4 ranks on 2 cores
# that took 1.4-1.8 ms for a small all-reduce or all-gather where gloo's all_gather took 3.2-3.8 ms, and at 4 MiB
# 16 ms per all-reduce against 37-80 ms for an all_gather and a sum (benchmarks/bench_collectives.py). nccl keeps
# its own collectives.


@dataclass
class ParallelState:
    """This rank's place in the world: tp = world size; DCP groups are consecutive tp ranks."""

    rank: int
    tp: int
    dcp: int
    device: torch.device
    tp_group: Any = None
    dcp_group: Any = None
    shm: dict[tuple[int, ...], ShmGroup] = field(default_factory=dict)  # member ranks -> segment

    @property
    def tp_members(self) -> tuple[int, ...]:
        return tuple(range(self.tp))

    @property
    def dcp_members(self) -> tuple[int, ...]:
        return dcp_members_of(self.rank, self.dcp)

    @property
    def world_size(self) -> int:
        return self.tp

    @property
    def dcp_rank(self) -> int:
        return self.dcp_members.index(self.rank)

    @property
    def distributed(self) -> bool:
        return self.tp > 1

    @property
    def collectives_path(self) -> str:
        """What the engine's collectives run on: none (one rank), nccl, shm (shared memory) or gloo."""
        if not self.distributed:
            return "none"
        return "nccl" if self.device.type == "cuda" else "shm" if self.shm else "gloo"

    @classmethod
    def single(cls, device: str = "cpu") -> "ParallelState":
        return cls(rank=0, tp=1, dcp=1, device=torch.device(device))

    @classmethod
    def from_launcher(cls, tp: int, dcp: int, device: str, timeout_s: float) -> "ParallelState":
        """Join the process group torchrun set up (env:// rendezvous), build the DCP groups and, when every
        rank runs on this machine on the CPU, their shared-memory segments (HARNESS_SHM_COLLECTIVES=0: none)."""
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
        dcp_groups = list(dict.fromkeys(dcp_members_of(r, dcp) for r in range(tp)))
        for members in dcp_groups:  # every rank creates every group, in the same order
            group = dist.new_group(list(members)) if dcp > 1 else None
            if rank in members:
                dcp_group = group
        state = cls(rank=rank, tp=tp, dcp=dcp, device=dev, tp_group=dist.group.WORLD, dcp_group=dcp_group)
        local = os.environ.get("LOCAL_WORLD_SIZE") == str(world)
        if device == "cpu" and local and shm_group.enabled(os.environ.get(shm_group.SHM_ENV)):
            groups = {state.tp_members: "TP group"}  # member ranks -> name in errors
            for members in dcp_groups if dcp > 1 else []:
                groups[members] = "TP/DCP group" if members == state.tp_members else "DCP group"
            state.shm = shm_group.open_groups(groups, rank, state.gather_objects(secrets.token_hex(8))[0],
                                              timeout_s, state.all_agree)
        return state

    def alone(self) -> "ParallelState":
        """This rank as a world of its own (an attention DP rank's group: every collective the identity)."""
        return ParallelState(rank=0, tp=1, dcp=1, device=self.device)

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

    def all_agree(self, ok: bool) -> bool:
        """True on every rank when every rank says `ok`."""
        return all(self.gather_objects(ok))

    def shutdown(self) -> None:
        self.shm = {}
        if dist.is_initialized():
            dist.destroy_process_group()


class Collectives:
    """The collectives the model needs, over the groups ParallelState owns."""

    def __init__(self, state: ParallelState) -> None:
        self._state = state

    @property
    def tp(self) -> int:
        return self._state.tp

    @property
    def dcp(self) -> int:
        return self._state.dcp

    @property
    def dcp_rank(self) -> int:
        return self._state.dcp_rank

    def reduce_tp(self, x: torch.Tensor) -> torch.Tensor:
        """Sum partial results of a row-parallel projection over the TP group (in place; returns x)."""
        if not self._state.distributed:
            return x
        shm = self._state.shm.get(self._state.tp_members)
        if shm is not None:  # each member sums every member's piece in member order
            flat = x.view(-1) if x.is_contiguous() else torch.empty(x.numel(), dtype=x.dtype, device=x.device)
            # parts [tp, n]; x's own piece is in its slot: x may be overwritten
            for start, parts in shm.pieces(x, "all_reduce"):
                _ordered_sum(parts.unbind(0), flat[start:start + parts.shape[1]])
            if not x.is_contiguous():
                x.copy_(flat.view(x.shape))
            return x
        group = self._state.tp_group
        if x.device.type != "cpu":  # nccl
            dist.all_reduce(x, group=group)
            return x
        out = x if x.is_contiguous() else torch.empty_like(x, memory_format=torch.contiguous_format)
        parts = self._star_gather(x, group, self._state.tp, to_all=False)  # [tp, *x.shape] at the first member
        if parts is not None:  # the group's first member sums in member order, rounding in x's dtype per add
            _ordered_sum(parts.unbind(0), out)
        dist.broadcast(out, src=dist.get_global_rank(group, 0), group=group)
        if out is not x:
            x.copy_(out)
        return x

    def gather_tp(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every TP rank's `x` along `dim`, in rank order."""
        return self._gather(x, dim, self._state.tp_group, self._state.tp_members)  # (0,) at tp1: x itself

    def gather_dcp(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every DCP-group member's `x` along `dim`, in member order."""
        return self._gather(x, dim, self._state.dcp_group, self._state.dcp_members)

    def stack_dcp(self, x: torch.Tensor) -> torch.Tensor:
        """[dcp, *x.shape]: every DCP-group member's `x`, in member order."""
        return self.gather_dcp(x.unsqueeze(0), dim=0)

    @staticmethod
    def _star_gather(x: torch.Tensor, group: Any, size: int, to_all: bool = True) -> torch.Tensor | None:
        """[size, *x.shape]: every member's `x` in member order, gathered at the group's first member and
        (with `to_all`) broadcast to the others; without `to_all`, None except on the first member."""
        root = dist.get_global_rank(group, 0)
        stacked = torch.empty((size, *x.shape), dtype=x.dtype, device=x.device)
        mine = dist.get_rank() == root
        dist.gather(x.contiguous(), list(stacked.unbind(0)) if mine else None, dst=root, group=group)
        if to_all:
            dist.broadcast(stacked, src=root, group=group)
        return stacked if to_all or mine else None

    def _gather(self, x: torch.Tensor, dim: int, group: Any, members: tuple[int, ...]) -> torch.Tensor:
        size = len(members)
        if size == 1:
            return x
        shm = self._state.shm.get(members)
        if shm is not None:
            stacked = torch.empty((size, x.numel()), dtype=x.dtype, device=x.device)  # [size, numel]
            for start, parts in shm.pieces(x, "all_gather"):  # parts [size, n]
                stacked[:, start:start + parts.shape[1]] = parts
            d = dim % x.dim()
            # [size, numel] -> [size, *x.shape] -> member axis beside `dim` -> members' blocks along `dim`
            return stacked.view(size, *x.shape).movedim(0, d).reshape(*x.shape[:d], size * x.shape[d], *x.shape[d + 1:])
        if x.device.type == "cpu":  # gloo
            stacked = self._star_gather(x, group, size)  # [size, *x.shape]
            assert stacked is not None
            return torch.cat(stacked.unbind(0), dim=dim)
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)


def _ordered_sum(parts: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """parts[0] + parts[1] + ... added left to right into `out`, rounding in its dtype after each add."""
    if len(parts) == 1:
        return out.copy_(parts[0])
    torch.add(parts[0], parts[1], out=out)
    for part in parts[2:]:
        out += part
    return out
