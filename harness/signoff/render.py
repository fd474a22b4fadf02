"""The sign-off page (one self-contained HTML file, inline CSS, no script, no URL), its Markdown twin, and
signoff.json beside them for CI.

signoff.json (SIGNOFF_SCHEMA_VERSION 1):

    {
      "schema_version": 1,
      "verdict": "SIGN-OFF" | "BLOCKED",
      "signed_off": true | false,
      "summary": "8 of 8 cells block the release: 2 new output corruption (2 silent), ...",  # the first line
      "counts": {"cells": 8, "blocking": 8,                  # blocking cells per category:
                 "new_output_corruption": 2,                 #   a FAIL of an output/layout check (silent or not)
                 "new_silent_corruption": 2,                 #   of which silent (clean exit)
                 "new_performance_only": 0,                  #   only performance checks FAIL (draft acceptance)
                 "new_error": 0,                             #   ERROR (infrastructure): PASS->ERROR, FAIL->ERROR
                 "still_failing": 0,                         #   failing with the same class as in the baseline
                 "not_run": 6},                              #   a cell the candidate's run never reached
      "references": [{"cell": "...", "verdict": "FAIL" | "PASS",   # cells whose reference changed since its
                      "recorded_by": "...", "accepted": "...",    #   recording, or whose recording carries an
                      "reason": "..."}],                           #   accepted numerics change (with its reason)
      "candidate": {"run_id": "...", "dirs": ["..."], "git_commit": "...", "report": "../cand/index.html"},
      "baseline": {...same keys...},
      "cells": [{"cell": "dcp/tiny-gqa/tp4dcp4/lengths/seed0",    # one per candidate cell (key_label)
                 "suite": "dcp", "model": "tiny-gqa", "topology": "tp4dcp4", "fault": null, "seed": 0,
                 "workload": "lengths", "baseline": "PASS" | null, "candidate": "FAIL",
                 "change": "new output corruption", "blocking": true,
                 "failure_class": "output" | "performance" | "infrastructure" | null,
                 "silent_corruption": true, "reason": "..."}]
    }
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, StrictUndefined

from harness import __version__
from harness.core.jsonio import write_json, write_text_atomic
from harness.report.history_strip import ERROR_COLOUR
from harness.report.matrix import format_number
from harness.report.merge import key_label
from harness.report.summary import md_escape
from harness.signoff.compare import (
    CATEGORIES,
    NEW_OUTPUT,
    NOT_RUN,
    Build,
    CellId,
    MetricDelta,
    Signoff,
    delta_changed,
    provenance_rows,
)

TEMPLATES = Path(__file__).resolve().parent / "templates"
HTML_FILE, MD_FILE, JSON_FILE = "signoff.html", "signoff.md", "signoff.json"
SIGNOFF_SCHEMA_VERSION = 1
# what the metric-delta table's multiples are: the same metric measured between the reference run and its
# noise run, which is what harness/flow/runner.py launches (the reference engine's noise_strategy())
NOISE_SENTENCE = ("Parity metrics as multiples of their measured noise floor: the same metric between the "
                  "reference run and its noise run (the embedded engine: the reference topology in the same dtype "
                  "with another reduction order; HTTP engines: the reference run again with other scheduling); "
                  "other checks by their key number. Changes first, largest first.")


def cell_label(cid: CellId) -> str:
    return key_label(cid)


def num(value: float | int | None) -> str:
    return format_number(value)


def pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def multiple_delta(old: float | None, new: float | None) -> str:
    if old is None or new is None:
        return "-"
    return f"{new - old:+.3g}"


@dataclass(frozen=True)
class Header:
    title: str
    text: str


def counts_text(s: Signoff) -> str:
    """'2 new output corruption (2 silent), 0 new performance-only, 0 new ERROR, 6 not run (missing coverage)'."""
    counts = s.counts()
    parts = []
    for change, key in CATEGORIES:
        n = counts[key]
        if change == NEW_OUTPUT:
            parts.append(f"{n} {change}" + (f" ({counts['new_silent_corruption']} silent)" if n else ""))
        elif change == NOT_RUN:
            parts.append(f"{n} not run (missing coverage)")
        elif n or key != "still_failing":
            parts.append(f"{n} {change}")
    return ", ".join(parts)


def header(s: Signoff) -> Header:
    if s.signed_off:
        return Header("SIGN-OFF", f"{len(s.changes)} cells checked: no new failure, nothing blocking; "
                                  f"{len(s.unchecked)} check(s) skipped or unavailable (listed below).")
    return Header("BLOCKED", f"{len(s.blocking)} of {len(s.changes)} cells block the release: {counts_text(s)}")


@dataclass(frozen=True)
class Side:
    """One build at the top of the page: its name, commit, folders and links to their reports."""

    role: str
    run_id: str
    commit: str
    dirs: tuple[str, ...]
    reports: tuple[tuple[str, str], ...]  # (folder, relative link to its index.html)


def side(role: str, build: Build, out_dir: Path) -> Side:
    commits = sorted({c for _, c, _ in build.runs if c})
    reports = []
    for d in build.dirs:
        page = (d if d.is_dir() else d.parent) / "index.html"
        if page.is_file():
            reports.append((str(d), os.path.relpath(page.resolve(), out_dir.resolve())))
    return Side(role, build.run_id, ", ".join(c[:12] for c in commits) or "-", tuple(str(d) for d in build.dirs),
                tuple(reports))


def split_deltas(s: Signoff) -> tuple[list[MetricDelta], list[MetricDelta]]:
    """(changed metrics, largest change first; unchanged ones)."""
    return [d for d in s.deltas if delta_changed(d)], [d for d in s.deltas if not delta_changed(d)]


def faults(build: Build) -> str:
    found = sorted({c.fault for c in build.cells.values() if c.fault})
    return ", ".join(found) if found else "none"


def render_html(s: Signoff, out_dir: Path = Path(".")) -> str:
    env = Environment(loader=FileSystemLoader(str(TEMPLATES)), autoescape=True, undefined=StrictUndefined,
                      trim_blocks=True, lstrip_blocks=True)
    env.globals.update(cell_label=cell_label, num=num, pct=pct, multiple_delta=multiple_delta)
    changed, unchanged = split_deltas(s)
    page = env.get_template("signoff.html.j2").render(
        s=s, head=header(s), sides=(side("candidate", s.candidate, out_dir), side("baseline", s.baseline, out_dir)),
        changed=changed, unchanged=unchanged, noise_sentence=NOISE_SENTENCE, error_colour=ERROR_COLOUR,
        json_file=JSON_FILE, cand_prov=provenance_rows(s.candidate), base_prov=provenance_rows(s.baseline),
        cand_faults=faults(s.candidate), base_faults=faults(s.baseline), harness_version=__version__,
        rendered=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    return page.replace("://", ":&#47;&#47;")


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(md_escape(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(md_escape(v) for v in row) + " |" for row in rows]
    return out


def render_markdown(s: Signoff, out_dir: Path = Path(".")) -> str:
    head = header(s)
    lines = [f"# {head.title}", "", md_escape(head.text), ""]
    for sd in (side("candidate", s.candidate, out_dir), side("baseline", s.baseline, out_dir)):
        links = ", ".join(f"[{md_escape(d)}]({link})" for d, link in sd.reports) or md_escape(", ".join(sd.dirs))
        lines.append(f"- **{sd.role}** {md_escape(sd.run_id)} (commit {sd.commit}): {links}")
    lines.append("")
    if s.blocking:
        lines += ["## Blocking cells", ""]
        lines += [f"- **{md_escape(c.label)}** ({c.change}): {md_escape(c.reason)}" for c in s.blocking] + [""]
    lines += ["## Verdicts: baseline -> candidate", ""]
    lines += _table(["cell", "baseline", "candidate", "change"],
                    [[cell_label(c.cell), c.old.value if c.old else "-", c.new.value if c.new else "-", c.change]
                     for c in s.changes]) + [""]
    if s.deltas:
        changed, unchanged = split_deltas(s)
        lines += ["## Metric deltas", "", md_escape(NOISE_SENTENCE), ""]
        if changed:
            lines += _table(["cell", "check", "metric", "baseline", "candidate", "delta", "unit"],
                            [[cell_label(d.cell), d.check, d.metric, num(d.old), num(d.new),
                              multiple_delta(d.old, d.new), d.unit] for d in changed]) + [""]
        else:
            lines += ["No metric changed.", ""]
        if unchanged:
            lines += [f"{len(unchanged)} metric(s) unchanged (same verdict, same number).", ""]
    if s.gsm8k:
        lines += ["## GSM8K", ""]
        lines += _table(["cell", "n", "baseline build", "candidate", "reference", "b/c", "McNemar p",
                         "min detectable drop (points)", "verdicts"],
                        [[cell_label(g.cell), num(g.n), pct(g.old_score), pct(g.new_score), pct(g.reference_score),
                          f"{num(g.b)}/{num(g.c)}", num(g.p_value), pct(g.min_detectable_drop), g.verdict]
                         for g in s.gsm8k]) + [""]
    if s.acceptance:
        lines += ["## Speculative acceptance length", ""]
        lines += _table(["cell", "baseline build", "candidate", "reference topology", "verdict"],
                        [[cell_label(a.cell), num(a.old), num(a.new), num(a.reference), a.verdict]
                         for a in s.acceptance]) + [""]
    if s.references:
        lines += ["## Recorded references: changed or accepted", ""]
        lines += _table(["cell", "verdict", "recorded by build", "accepted numerics change", "reason"],
                        [[cell_label(r.cell), r.verdict, r.recorded_by, r.accepted or "-", r.reason]
                         for r in s.references]) + [""]
    lines += ["## Provenance", ""]
    base = dict(provenance_rows(s.baseline))
    rows = [[k, base.get(k, "-"), v] for k, v in provenance_rows(s.candidate)]
    rows.append(["injected faults", faults(s.baseline), faults(s.candidate)])
    lines += _table(["", "baseline", "candidate"], rows) + [""]
    lines += ["## Skipped or unavailable checks", ""]
    lines += ([f"- {md_escape(cell_label(u.cell))} {md_escape(u.check)}: {md_escape(u.reason)}" for u in s.unchecked]
              or ["- none: every check ran"]) + [""]
    return "\n".join(lines)


def signoff_document(s: Signoff, out_dir: Path = Path(".")) -> dict[str, Any]:
    """What signoff.json holds (the module docstring describes its keys)."""
    def build(sd: Side, b: Build) -> dict[str, Any]:
        return {"run_id": b.run_id, "dirs": list(sd.dirs), "git_commit": sorted({c for _, c, _ in b.runs if c}),
                "reports": [link for _, link in sd.reports]}

    cells = []
    for c in s.changes:
        suite, model, topo, fault, seed, workload = c.cell
        cells.append({"cell": c.label, "suite": suite, "model": model, "topology": topo, "fault": fault,
                      "seed": seed, "workload": workload,
                      "baseline": c.old.value if c.old else None, "candidate": c.new.value if c.new else None,
                      "change": c.change, "blocking": c.blocking,
                      "failure_class": c.failure_class.value if c.failure_class else None,
                      "silent_corruption": c.silent, "reason": c.reason})
    head = header(s)
    return {"schema_version": SIGNOFF_SCHEMA_VERSION, "verdict": head.title, "signed_off": s.signed_off,
            "summary": head.text, "counts": s.counts(),
            "candidate": build(side("candidate", s.candidate, out_dir), s.candidate),
            "baseline": build(side("baseline", s.baseline, out_dir), s.baseline), "cells": cells,
            "references": [{"cell": cell_label(r.cell), "verdict": r.verdict, "recorded_by": r.recorded_by,
                            "accepted": r.accepted or None, "reason": r.reason} for r in s.references]}


def write_signoff(out_dir: Path, s: Signoff) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    html, md, js = out_dir / HTML_FILE, out_dir / MD_FILE, out_dir / JSON_FILE
    write_text_atomic(html, render_html(s, out_dir))  # each file complete on disk, whoever reads it meanwhile
    write_text_atomic(md, render_markdown(s, out_dir))
    write_json(js, signoff_document(s, out_dir))
    return {"html": html, "markdown": md, "json": js}
