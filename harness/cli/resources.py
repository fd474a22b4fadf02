"""Resource limits checked before any work, from the planner's own numbers (each failure: one line, exit 2): every
cell's and the reference's KV / state cache groups against the run's budget and slot length, and the reference's
weights against this machine's memory."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

from harness.arch.component import PlanError
from harness.arch.document import plan_sections
from harness.arch.model import model_of
from harness.arch.plan import plan_model
from harness.core.errors import ConfigError
from harness.formats.names import expected_shapes
from harness.specs.model import ModelSpec
from harness.specs.pool import PoolSettings
from harness.specs.topology import Topology

GIB = 1024 ** 3
FLOAT32_BYTES = 4  # the embedded engine holds every weight as float32 (harness/formats/weights.py: load_weights)


def check_cache_budgets(models: Sequence[ModelSpec], topologies: Sequence[Topology], budget_bytes: int,
                        max_seq_len: int) -> None:
    """Each model's plan at each topology (the reference's included) holds at least one sequence slot of
    `max_seq_len` tokens in `budget_bytes` per rank, in every cache group (KV pages, indexer keys, recurrent state,
    the MTP head's pages), exactly as `harness plan --budget-gib` computes it. A cell whose layout does not split is
    left to its SKIP."""
    block_size = PoolSettings().block_size
    for model in models:
        for topo in topologies:
            try:
                plan = plan_model(model_of(model), topo)
            except PlanError:  # the cell is a SKIP saying why (flow/runner.skip_reason)
                continue
            try:
                plan_sections(plan, budget_bytes, max_seq_len, block_size)
            except PlanError:
                continue
            except ConfigError as exc:
                raise ConfigError(f"{model.name} at {topo.name}: {exc}; raise --kv-budget-mib or lower "
                                  f"--max-seq-len (harness plan --model {model.name} --topo {topo.name} "
                                  f"--budget-gib N --max-seq-len N shows the groups)") from None


def weight_bytes(model: ModelSpec) -> int:
    """Bytes of every weight of `model` as the embedded engine loads it (float32, unsharded)."""
    return sum(math.prod(shape) for shape in expected_shapes(model).values()) * FLOAT32_BYTES


def machine_memory_bytes() -> int:
    """This machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def require_weight_memory(models: Sequence[ModelSpec], memory: int | None = None) -> None:
    """The reference loads a model's every weight (float32) in one process: a model larger than this machine's
    memory is one error with the figure and the limit, not an ERROR cell after a failed allocation."""
    limit = machine_memory_bytes() if memory is None else memory
    for model in models:
        need = weight_bytes(model)
        if need > limit:
            raise ConfigError(f"model {model.name}: its weights take {need / GIB:.1f} GiB as float32 (the reference "
                              f"loads them whole); this machine has {limit / GIB:.1f} GiB of memory; check hidden, "
                              f"ffn, vocab and layers")
