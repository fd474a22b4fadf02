"""The engine in this process at world size 1: for tests, benchmarks and the GSM8K wrapper at tp1."""

from __future__ import annotations

import torch

from harness.engine.runtime.engine import Engine
from harness.engine.runtime.generator import EngineGenerator
from harness.engine.runtime.parallel import ParallelState
from harness.formats.tokenizer import load_tokenizer
from harness.formats.weights import load_weights
from harness.specs.model import ModelSpec
from harness.specs.pool import PoolSettings


def reference_logits(spec: ModelSpec, weights: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """Logits [T, V] (float32) of one sequence at tp1 from a single prefill forward."""
    engine = Engine(spec, weights, ParallelState.single(), pool=PoolSettings(max_seq_len=max(16, len(ids))))
    return engine.prefill_logits([ids])[0]


class LocalGenerator(EngineGenerator):
    """Greedy batched generation at tp1 in this process (the GSM8K LM's generator protocol)."""

    def __init__(self, spec: ModelSpec, pool: PoolSettings = PoolSettings(), device: str = "cpu") -> None:
        super().__init__(Engine(spec, load_weights(spec), ParallelState.single(device), pool=pool),
                         load_tokenizer(spec))
