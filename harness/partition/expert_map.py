"""Redundant experts (EPLB-style): a logical-to-physical expert map with replicas, and the rule that sends
each routed token to exactly one physical replica.

Rules (docs/moe-dp.md):
- A model with `redundant_experts: R` has P = experts + R physical expert slots. Slot p < experts holds
  logical expert p; slot experts + r holds a replica of logical expert r % experts. Physical slots are
  placed over the EP ranks like experts without replicas: EP rank e holds slots [e P / ep, (e + 1) P / ep).
- A token routed to logical expert l goes to exactly one of its replicas: replicas(l)[token % n(l)], where
  `token` is the token's index in the (gathered) MoE batch, the same number on every rank; so its output
  is computed on one EP rank and summed once.

All functions are pure; invalid configurations raise one ConfigError naming the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.core.errors import ConfigError


@dataclass(frozen=True)
class ExpertMap:
    """Logical expert of each physical slot (slot order); replicas of one logical expert hold its weights."""

    experts: int  # logical experts
    slot_logical: tuple[int, ...]  # [P]: the logical expert slot p holds

    @property
    def physical(self) -> int:
        return len(self.slot_logical)

    @property
    def redundant(self) -> int:
        return self.physical - self.experts

    def replicas(self, logical: int) -> tuple[int, ...]:
        """The physical slots holding `logical`, in slot order."""
        return tuple(p for p, lg in enumerate(self.slot_logical) if lg == logical)

    def pick(self, logical: int, token: int) -> int:
        """The one physical slot a token (its index in the MoE batch) routed to `logical` is sent to."""
        reps = self.replicas(logical)
        return reps[token % len(reps)]

    def to_dict(self) -> dict[str, Any]:
        return {"experts": self.experts, "physical": self.physical, "redundant": self.redundant,
                "slot_logical": list(self.slot_logical),
                "replicas": {str(lg): list(self.replicas(lg)) for lg in range(self.experts)},
                "pick": "replicas(l)[token % len(replicas(l))], token = its index in the gathered MoE batch"}


def expert_map(experts: int, redundant: int) -> ExpertMap:
    """`experts` logical experts in slots 0..experts-1, then `redundant` replicas (slot experts + r holds
    logical r % experts)."""
    if experts < 1 or redundant < 0:
        raise ConfigError(f"expert map: experts={experts} must be positive and redundant_experts={redundant} "
                          f"non-negative")
    return ExpertMap(experts, tuple(range(experts)) + tuple(r % experts for r in range(redundant)))


def local_first_pick(emap: ExpertMap, logical: int, token: int, held: tuple[int, ...]) -> int:
    """The buggy pick (fault redundant-expert-twice): a rank prefers a replica it holds itself, else the
    rule; two ranks holding replicas of one expert then both compute it, and the sum counts it twice."""
    own = [p for p in emap.replicas(logical) if p in held]
    return own[0] if own else emap.pick(logical, token)
