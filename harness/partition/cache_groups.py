"""Grouped cache capacity (seed 004's rule): a model's cache groups (full KV pages, indexer keys,
recurrent states, an MTP head's pages, ...) share one budget as ONE whole number of per-sequence slots;
each group holds `slots x blocks_per_seq` blocks, so every group is slot-aligned.

Errors are named ConfigErrors, never a bare ValueError and never a clamp to one slot: an empty group list
(`NoCacheGroups`), a budget that cannot hold one slot (`CacheBudgetExhausted`, naming each group, its bytes
per slot, its share of the shortfall and the budget), and a group whose blocks are not a whole number of
slots (`CacheGroupUnaligned`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from harness.core.errors import ConfigError


class NoCacheGroups(ConfigError):
    """A grouped capacity asked of an empty list of cache groups."""


class CacheBudgetExhausted(ConfigError):
    """A budget that cannot hold one slot of every group."""


class CacheGroupUnaligned(ConfigError):
    """A group's capacity that is not the slot count times its blocks per slot."""


@dataclass(frozen=True)
class CacheGroup:
    """One cache group of a rank: `blocks_per_seq` blocks of `block_bytes` per sequence slot."""

    name: str
    blocks_per_seq: int
    block_bytes: int

    @property
    def slot_bytes(self) -> int:
        return self.blocks_per_seq * self.block_bytes


@dataclass(frozen=True)
class GroupedCapacity:
    budget_bytes: int
    slots: int
    groups: tuple[CacheGroup, ...]

    def blocks(self, name: str) -> int:
        return self.slots * self.group(name).blocks_per_seq

    def group(self, name: str) -> CacheGroup:
        for g in self.groups:
            if g.name == name:
                return g
        raise ConfigError(f"no cache group {name!r}; groups: {', '.join(g.name for g in self.groups)}")

    @property
    def slot_bytes(self) -> int:
        return sum(g.slot_bytes for g in self.groups)

    @property
    def pool_bytes(self) -> int:
        return self.slots * self.slot_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"budget_bytes": self.budget_bytes, "slots": self.slots, "slot_bytes": self.slot_bytes,
                "pool_bytes": self.pool_bytes,
                "groups": [{"name": g.name, "blocks_per_seq": g.blocks_per_seq, "block_bytes": g.block_bytes,
                            "blocks": self.blocks(g.name),
                            "bytes": self.blocks(g.name) * g.block_bytes}
                           for g in self.groups]}


def grouped_capacity(groups: tuple[CacheGroup, ...], budget_bytes: int, where: str = "per rank") -> GroupedCapacity:
    """One capacity in whole slots shared by every group; `where` names the device or rank in errors."""
    if not groups:
        raise NoCacheGroups(f"grouped cache capacity {where} needs at least one cache group, got none")
    for g in groups:
        if g.blocks_per_seq < 1 or g.block_bytes < 1:
            raise ConfigError(f"cache group {g.name}: blocks_per_seq={g.blocks_per_seq} and "
                              f"block_bytes={g.block_bytes} must be positive")
    if budget_bytes < 0:
        raise ConfigError(f"cache budget={budget_bytes} bytes must be non-negative")
    slot = sum(g.slot_bytes for g in groups)
    slots = budget_bytes // slot
    if slots < 1:
        short = slot - budget_bytes
        parts = "; ".join(f"{g.name}: {g.blocks_per_seq} blocks x {g.block_bytes} bytes = {g.slot_bytes} bytes, "
                          f"short by {_share(short, g.slot_bytes, slot)}" for g in groups)
        raise CacheBudgetExhausted(f"cache budget of {budget_bytes} bytes {where} cannot hold one sequence slot of "
                                   f"{slot} bytes across {len(groups)} cache groups (short by {short} bytes: {parts})")
    return GroupedCapacity(budget_bytes=budget_bytes, slots=slots, groups=groups)


def unaligned_groups(capacity: GroupedCapacity, held_blocks: Mapping[str, int]) -> list[str]:
    """What is wrong with the blocks each group holds (`held_blocks`: group name -> blocks): a group not a
    whole number of slots, or holding another slot count than the capacity's; one line per group."""
    out = []
    for g in capacity.groups:
        held = held_blocks.get(g.name)
        if held is None:
            out.append(f"cache group {g.name}: not allocated (planned {capacity.blocks(g.name)} blocks)")
        elif held % g.blocks_per_seq or held != capacity.blocks(g.name):
            whole = (f" = {held // g.blocks_per_seq} slots, not the groups' one count" if held % g.blocks_per_seq == 0
                     else " (not a whole number of slots)")
            out.append(f"cache group {g.name}: {held} blocks{whole}, planned {capacity.slots} slots x "
                       f"{g.blocks_per_seq} blocks per slot = {capacity.blocks(g.name)} blocks "
                       f"({g.slot_bytes} bytes per slot, budget {capacity.budget_bytes} bytes)")
    return out


def check_aligned(capacity: GroupedCapacity, held_blocks: Mapping[str, int], where: str = "per rank") -> None:
    """Raise CacheGroupUnaligned naming each group whose blocks are not `capacity`'s slot-aligned count."""
    problems = unaligned_groups(capacity, held_blocks)
    if problems:
        raise CacheGroupUnaligned(f"cache groups {where}: " + "; ".join(problems))


def _share(short: int, part: int, whole: int) -> str:
    """A group's part of the shortfall, in proportion to its slot bytes (rounded up)."""
    return f"{-(-short * part // whole)} bytes"
