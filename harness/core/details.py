"""A cell's drill-down details: the schema shared by the compare stage, which writes them, and the
report, which reads them (results.json `cells[].details`; harness/report/details.py renders it).

Sections are typed; the per-prompt metric rows inside `prompts` are each check's own rows (their
keys differ between the full-logits and the top-k checks) and GSM8K's section is its records'.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class LayoutDetails:
    """Planned (harness plan's layout) against actual (layout.json's entry) per rank."""

    planned: dict[str, Any] | None
    actual: dict[str, Any] | None


@dataclass(frozen=True)
class PromptDetails:
    """One prompt: its prefill, decode and generation rows (None where a check did not run)."""

    index: int
    prompt: str
    prefill: dict[str, Any] | None = None
    decode: dict[str, Any] | None = None
    generation: dict[str, Any] | None = None


@dataclass(frozen=True)
class LayerErrors:
    """Residual-stream relative error per hidden index (0 = embedding output, i = output of layer i-1)."""

    error: list[Any]
    threshold: list[Any] | float
    noise: list[Any] | None = None


@dataclass(frozen=True)
class HeadErrors:
    """Attention-output relative error per layer and head, with the owning ranks and KV heads."""

    error: list[Any]
    threshold: list[Any] | float
    owner_ranks: list[Any]
    kv_heads: list[Any]
    noise: list[Any] | None = None


@dataclass(frozen=True)
class SpeculatorDetails:
    """Acceptance of a -draft/-mtp cell against the reference with the same speculator."""

    kind: str = ""
    k: int | None = None
    histogram: list[int] | None = None
    reference_histogram: list[int] | None = None
    mean_acceptance: float | None = None
    reference_mean_acceptance: float | None = None
    traces_differ: int | None = None
    layout: dict[str, Any] | None = None  # {planned, actual} like LayoutDetails (older results)
    source: str | None = None               # "traces" (per verify step) or the engines' counters
    first_divergence: dict[str, Any] | None = None  # first verify step whose accept count differs:
    #   {prompt, step, position (new-token index), prompt_tokens, reference/parallel: {accepted, proposed, committed}}
    baseline_mean_acceptance: float | None = None   # baselines/acceptance.yaml, when the key has one
    baseline_histogram: list[int] | None = None
    baseline_verdict: str | None = None
    baseline_key: dict[str, Any] | None = None      # the reference's key (what `harness baseline update` writes)


def divergence_text(d: Mapping[str, Any]) -> str:
    """'prompt 2 verify step 5 (new token 9): reference accepted 3 of [..], parallel 1 of [..]'."""
    def side(name: str) -> str:
        e = d.get(name) or {}
        proposed = f" of {e['proposed']}" if e.get("proposed") is not None else ""
        return f"{name} accepted {e.get('accepted')}{proposed}"
    where = f" (new token {d['position']})" if d.get("position") is not None else ""
    sides = f": {side('reference')}, {side('parallel')}" if "reference" in d else ""
    return f"prompt {d['prompt']} verify step {d['step']}{where}{sides}"


_SECTIONS: dict[str, type] = {"layout": LayoutDetails, "speculator_layout": LayoutDetails,
                              "layer_errors": LayerErrors, "head_errors": HeadErrors,
                              "speculator": SpeculatorDetails}


def plain(value: Any) -> Any:
    """dataclasses.asdict without its deep copy of every leaf (the details of a 140-cell run hold half a million):
    dataclasses as dicts, lists, tuples and dicts rebuilt, anything else as it is."""
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple takes its fields one by one
        return type(value)(*(plain(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v) for v in value)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


@dataclass
class CellDetails:
    """Every section a cell may have; a section is None when its check did not run."""

    layout: LayoutDetails | None = None
    speculator_layout: LayoutDetails | None = None
    prompts: list[PromptDetails] | None = None
    layer_errors: LayerErrors | None = None
    head_errors: HeadErrors | None = None
    speculator: SpeculatorDetails | None = None
    gsm8k: dict[str, Any] | None = None
    collectives: dict[str, Any] | None = None  # per layer and site, the collectives' error (localize)
    requests: dict[str, Any] | None = None  # {"parallel", "reference"}: how an HTTP run's requests were sent
    #                                         (its manifest's `requests`, harness/backends/http/send.py)
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form, without the sections that are None."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if f.name == "prompts":
                out[f.name] = [plain(p) for p in value]
            elif f.name in _SECTIONS:
                out[f.name] = plain(value)
            else:
                out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CellDetails":
        """Parse details written by compare; an unknown section or key raises ValueError/TypeError."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown details sections {unknown}; known: {', '.join(sorted(known))}")
        parsed: dict[str, Any] = {}
        for key, value in data.items():
            if value is None:
                continue
            if key == "prompts":
                parsed[key] = [PromptDetails(**p) for p in value]
            elif key in _SECTIONS:
                parsed[key] = _SECTIONS[key](**value)
            else:
                parsed[key] = value
        return cls(**parsed)
