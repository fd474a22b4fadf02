"""The report's view of how an HTTP run's requests were sent (details `requests`: each run's manifest
`requests`, harness/backends/http/send.py): the schedule, the most requests open at once per phase, and
per request its case, phase, send and answer order and times."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.report.details import MAX_TABLE_ROWS, Facts, TableView, facts
from harness.report.matrix import format_number

COLUMNS: tuple[tuple[str, str], ...] = (("phase", "phase"), ("case", "prompt"), ("sent_order", "sent #"),
                                        ("answered_order", "answered #"), ("sent_s", "sent (s)"),
                                        ("answered_s", "answered (s)"))


@dataclass(frozen=True)
class RequestsView:
    runs: tuple[tuple[str, Facts, TableView], ...]  # (which run, schedule facts, requests table)


def _run_view(record: dict[str, Any]) -> tuple[Facts, TableView]:
    summary = {"schedule": record.get("schedule") or {}, "most in flight": record.get("max_in_flight_seen") or {}}
    raw = record.get("requests")
    rows = raw if isinstance(raw, list) else []
    table = TableView(columns=tuple(label for _, label in COLUMNS),
                      rows=tuple(tuple(format_number(r.get(key)) if isinstance(r, dict) else "" for key, _ in COLUMNS)
                                 for r in rows[:MAX_TABLE_ROWS]),
                      omitted=max(0, len(rows) - MAX_TABLE_ROWS))
    return facts(summary), table


def requests_view(data: Any) -> RequestsView | None:
    """{"parallel": record, "reference": record} -> the view; None when neither run has a record."""
    if not isinstance(data, dict):
        raise ValueError(f"details.requests is {type(data).__name__}, not an object")
    runs = tuple((who, *_run_view(record)) for who in ("parallel", "reference")
                 if isinstance(record := data.get(who), dict))
    return RequestsView(runs) if runs else None
