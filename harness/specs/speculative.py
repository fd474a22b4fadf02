"""SpeculativeSettings: how a -draft / -mtp run speculates (a suite's `speculative:` mapping, a job's
`speculative`). Engine-neutral: the embedded engine builds its speculator from it, an HTTP template passes k
to its server."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from harness.core.errors import ConfigError
from harness.specs.loader import build


@dataclass(frozen=True)
class SpeculativeSettings:
    """How a -draft / -mtp run speculates (a suite's `speculative:` mapping).

    k: draft tokens proposed per verify step. draft_noise: relative std of the noise added to the
    draft's layer weights (0 = exact copies of the target's first layers). mtp_hidden_mix: weight of
    the target hidden state against the token embedding in the MTP input (0 ignores the hidden state).
    """

    k: int = 3
    draft_noise: float = 0.1
    mtp_hidden_mix: float = 0.1

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ConfigError(f"speculative: k must be a positive integer, got {self.k!r}")
        for name in ("draft_noise", "mtp_hidden_mix"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 10:
                raise ConfigError(f"speculative: {name} must be a number in [0, 10), got {value!r}")
            object.__setattr__(self, name, float(value))

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None, where: str = "speculative") -> "SpeculativeSettings":
        """From a suite's `speculative:` mapping; unknown keys are rejected with "did you mean"."""
        return build(cls, where, dict(data or {}))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
