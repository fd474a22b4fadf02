"""The component protocol: what one architecture feature owns (docs/architecture.md, Architecture components).

A component plans what each rank holds of its feature (through the partition math of harness/partition/layout.py,
mla_layout.py and hybrid_layout.py, never its own), names the rank-report fields its layout check reads,
says where a fault is inert on it and why, and names the engine module (a string: planning stays
torch-free) that runs it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Protocol

from harness.core.errors import ConfigError
from harness.specs.model import ModelSpec
from harness.specs.topology import Topology


class PlanError(ConfigError):
    """A component's plan does not fit a topology; `component` names the component (the runner words a
    speculator that does not split apart from a model that does not)."""

    def __init__(self, message: str, component: str) -> None:
        super().__init__(message)
        self.component = component


class FaultEffects(Protocol):
    """What an injected fault changes that the plan layer can see (engine/faults.py FaultFlags has these)."""

    kv_layout_dcp: int | None
    naive_gqa: bool
    ffn_floor_split: bool
    vocab_floor_offset: bool
    linear_packed_contiguous: bool


@dataclass(frozen=True)
class FaultSite:
    """A fault-scope question: may fault `fault` (with `flags`) act on `spec` at `topology`, whose
    components planned `parts` (the ModelPlan's fields)?"""

    fault: str
    spec: ModelSpec
    topology: Topology
    flags: FaultEffects
    parts: Mapping[str, Any]

    def inert(self, why: str, at_topology: bool = True) -> str:
        where = f"{self.spec.name} at {self.topology.name}" if at_topology else self.spec.name
        return f"fault {self.fault} is inert on {where}: {why}"


class Component(ABC):
    """One architecture feature of a model."""

    name: ClassVar[str]
    engine_module: ClassVar[str]  # the torch module of the embedded engine that runs this feature
    report_fields: ClassVar[tuple[str, ...]]  # rank-report fields its layout check compares with its plan
    layout_check: ClassVar[str] = "attention"  # the check of the target's rank reports (checks/builtin.py)
    faults: ClassVar[frozenset[str]] = frozenset()  # faults that act on this feature only (inert elsewhere)
    takes_ep: ClassVar[bool] = False  # it splits over the expert-parallel ranks (topology ep > 1)
    takes_dp: ClassVar[bool] = False  # it runs under attention data parallel (topology dp > 1)
    prefix_cacheable: ClassVar[bool] = True  # a sequence's cached state of a prompt prefix can serve another

    def inert_reason(self, site: FaultSite) -> str | None:
        """Why fault `site.fault` cannot change this component's computation on the site, or None."""
        return None

    def export_refusal(self, spec: ModelSpec) -> str | None:
        """Why `harness export` cannot write this feature as a Hugging Face folder, or None."""
        return None

    def embedded_refusal(self, spec: ModelSpec) -> str | None:
        """Why the embedded engine cannot run this feature of `spec` (planned and served elsewhere), or None."""
        return None

    def served_refusal(self, spec: ModelSpec, engine: str) -> str | None:
        """Why an HTTP engine given a Hugging Face export cannot run this feature, or None."""
        return None

    @abstractmethod
    def plan(self, spec: ModelSpec, topo: Topology) -> dict[str, Any]:
        """This component's fields of the ModelPlan (plan.py)."""
