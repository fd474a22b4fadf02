"""PoolSettings: the KV pool an engine is given (a job's `pool`, `harness serve --kv-budget-mib`): its byte
budget, the longest sequence it must hold and its block size. Engine-neutral: the embedded engine sizes its
paged cache from it, an HTTP backend passes the budget and length to the server it starts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from harness.specs.loader import check_keys, expect_int


@dataclass(frozen=True)
class PoolSettings:
    budget_bytes: int = 256 * 1024 ** 2
    max_seq_len: int = 1024
    block_size: int = 16

    def to_dict(self) -> dict[str, int]:
        return {"budget_bytes": self.budget_bytes, "max_seq_len": self.max_seq_len, "block_size": self.block_size}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "pool") -> "PoolSettings":
        """The settings to_dict wrote (missing keys take their defaults)."""
        check_keys(where, data, ("budget_bytes", "max_seq_len", "block_size"))
        return cls(**{name: expect_int(where, name, value, minimum=1) for name, value in data.items()})
