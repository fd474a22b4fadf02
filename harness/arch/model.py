"""A model as the list of its architecture components, derived from its ModelSpec: the one place that
reads the spec's architecture fields (kv_lora_rank for MLA, the hybrid and sparse mappings)."""

from __future__ import annotations

from dataclasses import dataclass

from harness.arch.component import Component
from harness.arch.components import (
    Attention,
    GatedAttention,
    GatedDeltaNet,
    LatentAttention,
    MoE,
    SparseAttention,
    Speculator,
)
from harness.core.errors import ConfigError
from harness.partition.hybrid_layout import HybridShape
from harness.partition.sparse_layout import SparseShape
from harness.specs.model import ModelSpec


@dataclass(frozen=True)
class Model:
    """A model spec and its components: its attention first, then its other layers' features; the
    speculator (draft / MTP) is planned only on a topology that asks for one."""

    spec: ModelSpec
    components: tuple[Component, ...]
    speculator: Speculator

    @property
    def attention(self) -> Component:
        """The component holding the KV cache: its engine module builds the rank's decoder."""
        return self.components[0]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.components)

    @property
    def prefix_cacheable(self) -> bool:
        """Whether a cached prompt prefix of one sequence can serve another (not with recurrent state)."""
        return all(c.prefix_cacheable for c in self.components)

    @property
    def takes_ep(self) -> bool:
        return any(c.takes_ep for c in self.components)

    def export_refusal(self) -> str | None:
        """Why `harness export` cannot write the model as a Hugging Face folder, or None."""
        return next((r for c in self.components if (r := c.export_refusal(self.spec)) is not None), None)

    def embedded_refusal(self) -> str | None:
        """Why the embedded engine cannot run the model (a component it does not implement, or what the checkpoint
        has that it does not: the spec's engine_gaps), or None."""
        found = next((r for c in self.components if (r := c.embedded_refusal(self.spec)) is not None), None)
        if found is None and self.spec.engine_gaps:
            found = (f"model {self.spec.name!r}: the embedded engine does not implement "
                     f"{'; '.join(self.spec.engine_gaps)} (harness plan explains the layout; vllm / sglang serve it)")
        return found

    def served_refusal(self, engine: str) -> str | None:
        """Why HTTP engine `engine`, given a Hugging Face export, cannot run the model, or None."""
        return next((r for c in self.components if (r := c.served_refusal(self.spec, engine)) is not None), None)

    def sparse_shape(self) -> SparseShape:
        """The indexer numbers of a sparse-attention model (the engine's sparse module reads them)."""
        if self.spec.sparse is None:
            raise ConfigError(f"model {self.spec.name!r} has no sparse attention (no indexer)")
        return self.spec.sparse

    def hybrid_shape(self) -> HybridShape:
        """The linear-attention / MoE numbers of a hybrid model (the engine's hybrid module reads them)."""
        if self.spec.hybrid is None:
            raise ConfigError(f"model {self.spec.name!r} has no linear attention or MoE layers")
        return self.spec.hybrid


def model_of(spec: ModelSpec) -> Model:
    """The components of `spec`: MLA, hybrid (gated attention, MoE, linear attention), sparse or dense attention."""
    h = spec.hybrid
    if h is not None:
        moe: tuple[Component, ...] = (MoE(h),) if h.experts else ()
        return Model(spec, (GatedAttention(h), *moe, GatedDeltaNet(h)), Speculator(copies_target=False))
    if spec.mla:
        experts: tuple[Component, ...] = (MoE(spec.moe),) if spec.moe is not None else ()
        return Model(spec, (LatentAttention(), *experts), Speculator(deepseek_mtp=True))
    if spec.sparse is not None:
        return Model(spec, (SparseAttention(spec.sparse),), Speculator())
    return Model(spec, (Attention(),), Speculator())
