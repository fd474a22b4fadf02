"""One object a check reads everything from (instead of long positional argument lists), and
where checks leave the cell's drill-down details and localization."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from harness.checks.settings import CheckSettings
from harness.compare.parity.jumps import JumpEvidence
from harness.core.details import CellDetails
from harness.core.paths import BASELINES_DIR
from harness.core.verdict import CheckResult, Localization
from harness.gsm8k.settings import GSM8KSettings
from harness.partition.hybrid_layout import HybridPlan, MoePlan
from harness.partition.layout import LayoutPlan
from harness.partition.pd_layout import PDPlan
from harness.partition.pd_state import PDStatePlan
from harness.partition.sparse_layout import SparsePlan
from harness.records.artifacts import RunArtifacts
from harness.records.contract import Capabilities

Decoder = Callable[[Sequence[int]], str]


@dataclass(frozen=True)
class CellInfo:
    """Which cell: names as results carry them, and where its report goes."""

    suite: str = ""
    model: str = ""
    topology: str = ""
    speculator: str = "none"
    engine: str = "embedded"
    reference_engine: str = "embedded"
    report_dir: str = ""
    baselines_dir: Path = BASELINES_DIR
    workload: str = "prompts"
    workloads_run: bool = False  # the run ran workloads (Job.workloads): it holds their twin and re-prefill


@dataclass
class CellContext:
    """Inputs of every check of one cell, and the outputs they add (details, localization)."""

    ref: RunArtifacts
    par: RunArtifacts
    noise: RunArtifacts | None
    plan: LayoutPlan
    settings: CheckSettings
    par_caps: Capabilities
    ref_caps: Capabilities
    info: CellInfo = field(default_factory=CellInfo)
    # the run `noise` is measured against (None: `ref`; compare/parity/noise_source.py)
    noise_ref: RunArtifacts | None = None
    noise_source: str = ""  # where the noise comes from when not the reference engine's own noise run
    # the reference engine's jumps under rounding alone over every greedy workload's cases of the reference and noise
    # runs (compare/parity/jumps.py: a property of the engine, model and dtype); None: from this workload's views
    jump_evidence: JumpEvidence | None = None
    speculator_plan: LayoutPlan | None = None
    hybrid_plan: HybridPlan | None = None  # hybrid models: linear attention, MoE, cache groups
    moe_plan: MoePlan | None = None  # the experts of a model whose attention is not hybrid (MLA + MoE)
    indexer_plan: SparsePlan | None = None  # sparse attention: the indexer's split
    pd_plan: PDPlan | None = None  # disaggregated cells: each decode rank's KV assembly from the prefill ranks
    pd_state_plan: PDStatePlan | None = None  # ... and a hybrid model's linear-attention state assembly
    layout_check: str = "attention"  # the check of the target's layout its attention component names
    decode: Decoder | None = None
    gsm8k: GSM8KSettings | None = None
    enabled: Callable[[str], bool] = lambda section: True
    results: list[CheckResult] = field(default_factory=list)        # verdicts so far, in registry order
    details: CellDetails = field(default_factory=CellDetails)      # the report's drill-down (harness/core/details.py)
    prompt_rows: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # per path: each check's prompt rows
    localization: Localization | None = None

    @property
    def noise_base(self) -> RunArtifacts:
        """The run the noise run is measured against: the reference, or the run the noise source names."""
        return self.ref if self.noise_ref is None else self.noise_ref

    @property
    def top_k(self) -> int:
        """k the top-k logits checks compare: what both runs give."""
        return min(self.par_caps.top_k, self.ref_caps.top_k)

    def both_have(self, capability: str) -> bool:
        return self.par_caps.has(capability) and self.ref_caps.has(capability)

    def result(self, name: str) -> CheckResult | None:
        return next((r for r in self.results if r.name == name), None)

    def missing(self, requires: Sequence[str], requires_any: Sequence[str]) -> str | None:
        """'engine embedded-topk gives no hidden_states' for the first unmet need, or None."""
        sides = ((self.info.engine, self.par_caps), (self.info.reference_engine, self.ref_caps))
        for cap in requires:
            for engine, caps in sides:
                if not caps.has(cap):
                    return f"engine {engine} gives no {cap}"
        if requires_any:
            for engine, caps in sides:
                if not any(caps.has(cap) for cap in requires_any):
                    return f"engine {engine} gives none of {', '.join(requires_any)}"
        return None
