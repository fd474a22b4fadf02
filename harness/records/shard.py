"""Sharding a run's matrix over machines: `harness run ... --shard K/N`.

A pure, deterministic split: every machine computes the same plan, so shard K of N runs the same
cells wherever it runs. Cells are spread by an estimate of their cost (longest first onto the
least-loaded share, ties to the lower shard), and each share keeps the plan's order. Every cell
is in exactly one share; references are cached per share (each machine's own cache).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol, Sequence, TypeVar

from harness.core.errors import ConfigError
from harness.specs.topology import Topology

T = TypeVar("T")
_SHARD_RE = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")

# cost model: a launch costs its process start-up plus work per rank; a speculator about doubles
# the decode work; a skipped cell costs nothing. Only ratios matter.
LAUNCH_COST = 4.0
RANK_COST = 1.0
SPECULATOR_FACTOR = 2.0


@dataclass(frozen=True)
class Shard:
    """Shard `index` (1-based) of `count`."""

    index: int
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def parse_shard(text: str) -> Shard:
    """'K/N' with 1 <= K <= N; anything else is one ConfigError naming the value."""
    match = _SHARD_RE.match(text)
    if not match:
        raise ConfigError(f"--shard {text!r} is not K/N (e.g. 1/4: the first of four shares)")
    index, count = int(match.group(1)), int(match.group(2))
    if count < 1 or not 1 <= index <= count:
        raise ConfigError(f"--shard {text!r}: K must be between 1 and N (N >= 1), e.g. 1/{max(count, 1)}")
    return Shard(index, count)


def cell_cost(world_size: int, speculator: bool, skipped: bool) -> float:
    """The estimated cost of one cell (arbitrary units)."""
    if skipped:
        return 0.0
    return (LAUNCH_COST + RANK_COST * world_size) * (SPECULATOR_FACTOR if speculator else 1.0)


def assign(costs: Sequence[float], count: int) -> list[int]:
    """For each item, the 0-based share it goes to: longest-processing-time-first over `count` shares.

    Items are taken by decreasing cost (ties: plan order); each goes to the share with the least
    load so far (ties: the lower share). Zero-cost items are spread round-robin so that no share
    collects every skip."""
    if count < 1:
        raise ConfigError(f"shard count {count} must be >= 1")
    loads = [0.0] * count
    owner = [0] * len(costs)
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    free = 0
    for i in order:
        if costs[i] <= 0:
            owner[i] = free % count
            free += 1
            continue
        share = min(range(count), key=lambda s: (loads[s], s))
        owner[i] = share
        loads[share] += costs[i]
    return owner


def select(items: Sequence[T], costs: Sequence[float], shard: Shard) -> list[T]:
    """The items of `shard`, in their original order."""
    if len(items) != len(costs):
        raise ValueError(f"{len(items)} items but {len(costs)} costs")
    owner = assign(costs, shard.count)
    return [item for item, o in zip(items, owner) if o == shard.index - 1]


class PlannedCell(Protocol):
    """What sharding reads of a planned cell (the runner's CellPlan)."""

    @property
    def topology(self) -> Topology: ...

    @property
    def skip_reason(self) -> str | None: ...


C = TypeVar("C", bound=PlannedCell)


def shard_cells(cells: Sequence[C], shard: Shard | None) -> list[C]:
    """The planned cells of `shard` (all of them without one), cost-balanced, in plan order."""
    if shard is None:
        return list(cells)
    costs = [cell_cost(c.topology.world_size, c.topology.speculator != "none", c.skip_reason is not None)
             for c in cells]
    return select(cells, costs, shard)
