"""Sharding a run's matrix over machines: `harness run ... --shard K/N`, or `--shard env` (from the scheduler).

A pure, deterministic split: every machine computes the same plan, so shard K of N runs the same
cells wherever it runs. Cells are spread by an estimate of their cost (longest first onto the
least-loaded share, ties to the lower shard), and each share keeps the plan's order. Every cell
is in exactly one share. Shares sharing one --cache-dir compute each reference once (harness/flow/refcache.py).

`--shard env` reads the share from the scheduler's environment (shard_from_env): a Slurm array task
(SLURM_ARRAY_TASK_ID, SLURM_ARRAY_TASK_MIN, SLURM_ARRAY_TASK_COUNT), a Kubernetes Indexed Job's
JOB_COMPLETION_INDEX with the count in HARNESS_SHARD_COUNT (the Job's completions; Kubernetes sets no count),
or Buildkite's parallel job (BUILDKITE_PARALLEL_JOB, BUILDKITE_PARALLEL_JOB_COUNT). With `--cells-from` the
costs are the cell list's estimated seconds (measured durations where the history has them), so every share
computes the same split from the same file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence, TypeVar

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


def parse_shard(text: str, env: Mapping[str, str] | None = None) -> Shard:
    """'K/N' with 1 <= K <= N, or 'env' (shard_from_env of `env`); anything else is one ConfigError naming the
    value."""
    if text.strip() == SHARD_ENV:
        return shard_from_env(env if env is not None else {})
    match = _SHARD_RE.match(text)
    if not match:
        raise ConfigError(f"--shard {text!r} is neither K/N (e.g. 1/4: the first of four shares) nor env (the "
                          f"scheduler's array index)")
    index, count = int(match.group(1)), int(match.group(2))
    if count < 1 or not 1 <= index <= count:
        raise ConfigError(f"--shard {text!r}: K must be between 1 and N (N >= 1), e.g. 1/{max(count, 1)}")
    return Shard(index, count)


SHARD_ENV = "env"
SHARD_COUNT_ENV = "HARNESS_SHARD_COUNT"


def _env_int(env: Mapping[str, str], name: str, minimum: int) -> int:
    text = env.get(name, "").strip()
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"--shard env: {name}={text!r} is not a whole number") from None
    if value < minimum:
        raise ConfigError(f"--shard env: {name}={value} must be >= {minimum}")
    return value


def shard_from_env(env: Mapping[str, str]) -> Shard:
    """The share a scheduler's environment names (see the module doc); no scheduler's variables, or
    inconsistent ones, is one ConfigError naming what was read and what is expected."""
    if "SLURM_ARRAY_TASK_ID" in env:
        task, count = _env_int(env, "SLURM_ARRAY_TASK_ID", 0), _env_int(env, "SLURM_ARRAY_TASK_COUNT", 1)
        first = _env_int(env, "SLURM_ARRAY_TASK_MIN", 0) if "SLURM_ARRAY_TASK_MIN" in env else 0
        index = task - first + 1
        where = f"SLURM_ARRAY_TASK_ID={task} (min {first}) of SLURM_ARRAY_TASK_COUNT={count}"
    elif "JOB_COMPLETION_INDEX" in env:
        if SHARD_COUNT_ENV not in env:
            raise ConfigError(f"--shard env: JOB_COMPLETION_INDEX is set (a Kubernetes Indexed Job) but "
                              f"{SHARD_COUNT_ENV} is not; set it to the Job's completions")
        index = _env_int(env, "JOB_COMPLETION_INDEX", 0) + 1
        count = _env_int(env, SHARD_COUNT_ENV, 1)
        where = f"JOB_COMPLETION_INDEX={index - 1} of {SHARD_COUNT_ENV}={count}"
    elif "BUILDKITE_PARALLEL_JOB" in env:
        index = _env_int(env, "BUILDKITE_PARALLEL_JOB", 0) + 1
        count = _env_int(env, "BUILDKITE_PARALLEL_JOB_COUNT", 1)
        where = f"BUILDKITE_PARALLEL_JOB={index - 1} of BUILDKITE_PARALLEL_JOB_COUNT={count}"
    else:
        raise ConfigError("--shard env: no scheduler's shard variables are set (SLURM_ARRAY_TASK_ID + "
                          "SLURM_ARRAY_TASK_COUNT, JOB_COMPLETION_INDEX + HARNESS_SHARD_COUNT, or "
                          "BUILDKITE_PARALLEL_JOB + BUILDKITE_PARALLEL_JOB_COUNT); give --shard K/N instead")
    if not 1 <= index <= count:
        raise ConfigError(f"--shard env: {where} is not a share of {count} (the index must count from the "
                          f"first task up to the count)")
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


def shard_cells(cells: Sequence[C], shard: Shard | None, estimates: Sequence[float] | None = None) -> list[C]:
    """The planned cells of `shard` (all of them without one), balanced by `estimates` (seconds per cell, e.g.
    from a cell list) or else by the cost model, in plan order."""
    if shard is None:
        return list(cells)
    costs = list(estimates) if estimates is not None else [
        cell_cost(c.topology.world_size, c.topology.speculator != "none", c.skip_reason is not None) for c in cells]
    return select(cells, costs, shard)
