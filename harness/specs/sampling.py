"""Sampling settings of a workload: what a sampled request asks of the engine (temperature, top-k, top-p, min-p,
repetition / presence / frequency penalties, a per-request seed, draws per position), as plain data.

The order they act in is vLLM's and the embedded engine's (harness/engine/runtime/sampler.py); the distribution
check (harness/compare/sampling.py) recomputes the same processed distribution from the reference's logits:

1. penalties on the raw logits: `repetition_penalty` r over every token of prompt + output (a positive logit
   divided by r, a negative one multiplied), then `presence_penalty` (subtracted once from each output token's
   logit) and `frequency_penalty` (subtracted once per occurrence in the output);
2. `temperature`: logits / temperature;
3. `min_p`: tokens whose probability is below min_p x the largest probability are masked;
4. `top_k`: all but the k largest logits masked (0: off);
5. `top_p`: the smallest set of most probable tokens whose renormalized mass reaches top_p is kept (1.0: off);
6. the rest renormalized and drawn from.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping

from harness.core.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    """One workload's sampling settings; `seed` seeds every request's generator (the request's own seed is
    derived from it and the prompt it sends, so a prompt sent twice draws the same tokens), `n` is the number
    of draws per teacher-forced position the distribution check takes."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = 0
    n: int = 1

    def __post_init__(self) -> None:
        problems = [msg for bad, msg in (
            (not self.temperature > 0, f"temperature={self.temperature} must be > 0 (greedy is no sampling)"),
            (self.top_k < 0, f"top_k={self.top_k} must be >= 0 (0: off)"),
            (not 0 < self.top_p <= 1, f"top_p={self.top_p} must be in (0, 1]"),
            (not 0 <= self.min_p < 1, f"min_p={self.min_p} must be in [0, 1)"),
            (not self.repetition_penalty > 0, f"repetition_penalty={self.repetition_penalty} must be > 0"),
            (self.n < 1, f"n={self.n} must be >= 1"),
            (self.seed < 0, f"seed={self.seed} must be >= 0")) if bad]
        if problems:
            raise ConfigError("sampling: " + "; ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SamplingParams:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"sampling: unknown keys {unknown}; valid: {', '.join(sorted(known))}")
        return cls(**dict(data))

    def request_seed(self, prompt: int) -> int:
        """The generator seed of a request sending prompt number `prompt` (its index in the workload's lengths)."""
        return self.seed * 1_000_003 + prompt

    def describe(self) -> str:
        parts = [f"temperature {self.temperature:g}"]
        parts += [f"{name} {value:g}" for name, value, off in (
            ("top_k", self.top_k, 0), ("top_p", self.top_p, 1.0), ("min_p", self.min_p, 0.0),
            ("repetition_penalty", self.repetition_penalty, 1.0), ("presence_penalty", self.presence_penalty, 0.0),
            ("frequency_penalty", self.frequency_penalty, 0.0)) if value != off]
        return ", ".join(parts) + f", seed {self.seed}, {self.n} draws per position"
