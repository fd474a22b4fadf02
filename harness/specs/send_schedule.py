"""SendSchedule: how an HTTP run sends a job's requests, one request per case (a job's `request_schedule`;
harness/backends/http/send.py sends them and documents the schedules). Engine-neutral and torch-free, so the
run contract's Job can hold it typed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from harness.core.errors import ConfigError
from harness.specs.workload import ALL_AT_ONCE, ONE_AT_A_TIME, SCHEDULES, STAGGERED

__all__ = ["ALL_AT_ONCE", "ONE_AT_A_TIME", "SCHEDULES", "STAGGERED", "SendSchedule"]
_PARAMS: dict[str, tuple[str, ...]] = {ONE_AT_A_TIME: (), ALL_AT_ONCE: ("max_in_flight",),
                                       STAGGERED: ("max_in_flight", "wave", "delay_s")}


@dataclass(frozen=True)
class SendSchedule:
    """A parsed schedule (the schedules: harness/backends/http/send.py)."""

    name: str
    max_in_flight: int = 8
    wave: int = 1
    delay_s: float = 0.05

    def __post_init__(self) -> None:
        if self.name not in SCHEDULES:
            raise ConfigError(f"request schedule {self.name!r} is not one of {', '.join(SCHEDULES)}")
        if self.max_in_flight < 1 or self.wave < 1:
            raise ConfigError(f"request schedule {self.name}: max_in_flight={self.max_in_flight} and "
                              f"wave={self.wave} must be >= 1")
        if not self.delay_s >= 0:
            raise ConfigError(f"request schedule {self.name}: delay_s={self.delay_s} must be >= 0")

    @classmethod
    def parse(cls, value: str | Mapping[str, Any]) -> SendSchedule:
        """'all-at-once', 'staggered:wave=2,delay_s=0.1' or {"name": "staggered", "wave": 2}."""
        if isinstance(value, str):
            name, _, rest = value.strip().partition(":")
            pairs = [p.partition("=") for p in rest.split(",") if p.strip()] if rest else []
            if any(not sep for _, sep, _ in pairs):
                raise ConfigError(f"request schedule {value!r}: parameters are key=value, e.g. "
                                  f"'staggered:wave=2,delay_s=0.1'")
            params: dict[str, Any] = {k.strip(): v.strip() for k, _, v in pairs}
        elif isinstance(value, Mapping):
            params = dict(value)
            name = str(params.pop("name", ""))
        else:
            raise ConfigError(f"request schedule {value!r} must be a string or a mapping")
        if name not in SCHEDULES:
            raise ConfigError(f"request schedule {name!r} is not one of {', '.join(SCHEDULES)}")
        unknown = sorted(set(params) - set(_PARAMS[name]))
        if unknown:
            allowed = ", ".join(_PARAMS[name]) or "none"
            raise ConfigError(f"request schedule {name}: unknown parameter(s) {', '.join(unknown)} (takes: {allowed})")
        try:
            typed = {k: (float(v) if k == "delay_s" else int(v)) for k, v in params.items()}
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"request schedule {name}: {params} must be numbers ({exc})") from exc
        return cls(name=name, **typed)

    @classmethod
    def from_workload(cls, workload: Mapping[str, Any]) -> SendSchedule:
        """A workload's schedule (harness/specs/workload.py's `schedule` and `join_per_step`, the requests
        joining per engine step: over HTTP, the wave size of a staggered schedule)."""
        name = str(workload.get("schedule", ""))
        wave = int(workload.get("join_per_step", 1) or 1)
        return cls.parse({"name": name, "wave": wave} if name == STAGGERED else {"name": name})

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **{k: getattr(self, k) for k in _PARAMS[self.name]}}
