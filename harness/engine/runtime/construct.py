"""The one way a rank builds its engine, shared by the run's rank worker (harness/backends/embedded/worker.py)
and `harness serve`'s (harness/serve/worker.py): the tokenizer and weights of the model, the Engine with the
fault's flags, KV pool, dtype and the topology's parallel layout, and the speculator of a -draft / -mtp
topology."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.engine.faults import fault_flags
from harness.engine.runtime.engine import Engine
from harness.engine.runtime.parallel import ParallelState
from harness.engine.speculative.speculator import Speculator, speculator_for
from harness.formats.tokenizer import Tokenizer, load_tokenizer
from harness.formats.weights import load_weights
from harness.specs.model import ModelSpec
from harness.specs.pool import PoolSettings
from harness.specs.speculative import SpeculativeSettings
from harness.specs.topology import Topology


@dataclass(frozen=True)
class RankEngine:
    """What a rank serves a job or requests with. `speculator` is None unless the topology speculates."""

    engine: Engine
    tokenizer: Tokenizer
    weights: dict[str, torch.Tensor]
    speculator: Speculator | None


def build_engine(state: ParallelState, model: ModelSpec, topology: Topology, fault: str | None,
                 pool: PoolSettings, dtype: str | None, speculative: SpeculativeSettings) -> RankEngine:
    """This rank's engine for `model` at `topology` (every rank calls it, in the same order)."""
    tokenizer = load_tokenizer(model)
    weights = load_weights(model)
    engine = Engine(model, weights, state, fault_flags(fault, topology), pool, dtype, ep=topology.ep, dp=topology.dp,
                    speculator=topology.speculator, placement=topology.placement,
                    q_replicated=topology.q_replicated)
    speculator = (speculator_for(engine, topology.speculator, weights, speculative)
                  if topology.speculator != "none" else None)
    return RankEngine(engine, tokenizer, weights, speculator)
