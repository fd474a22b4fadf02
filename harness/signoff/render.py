"""The sign-off page (one self-contained HTML file, inline CSS, no script, no URL) and its Markdown twin."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from jinja2 import Environment, FileSystemLoader, StrictUndefined

from harness import __version__
from harness.report.matrix import format_number
from harness.report.summary import md_escape
from harness.signoff.compare import Build, CellId, Signoff, provenance_rows

TEMPLATES = Path(__file__).resolve().parent / "templates"
HTML_FILE, MD_FILE = "signoff.html", "signoff.md"


def cell_label(cid: CellId) -> str:
    suite, model, topo, seed = cid
    return f"{suite}/{model}/{topo}/seed{seed}"


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


def header(s: Signoff) -> Header:
    if s.signed_off:
        return Header("SIGN-OFF", f"{len(s.changes)} cells checked: no new failure, nothing blocking; "
                                  f"{len(s.unchecked)} check(s) skipped or unavailable (listed below).")
    return Header("BLOCKED", f"{len(s.blocking)} of {len(s.changes)} cells block the release: "
                             + ", ".join(c.label for c in s.blocking))


def faults(build: Build) -> str:
    found = sorted({c.fault for c in build.cells.values() if c.fault})
    return ", ".join(found) if found else "none"


def render_html(s: Signoff) -> str:
    env = Environment(loader=FileSystemLoader(str(TEMPLATES)), autoescape=True, undefined=StrictUndefined,
                      trim_blocks=True, lstrip_blocks=True)
    env.globals.update(cell_label=cell_label, num=num, pct=pct, multiple_delta=multiple_delta)
    page = env.get_template("signoff.html.j2").render(
        s=s, head=header(s), cand_prov=provenance_rows(s.candidate), base_prov=provenance_rows(s.baseline),
        cand_faults=faults(s.candidate), base_faults=faults(s.baseline), harness_version=__version__,
        rendered=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    return page.replace("://", ":&#47;&#47;")


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(md_escape(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(md_escape(v) for v in row) + " |" for row in rows]
    return out


def render_markdown(s: Signoff) -> str:
    head = header(s)
    lines = [f"# {head.title}", "", md_escape(head.text), ""]
    if s.blocking:
        lines += ["## Blocking cells", ""]
        lines += [f"- **{md_escape(c.label)}** ({c.change}): {md_escape(c.reason)}" for c in s.blocking] + [""]
    lines += ["## Verdicts: baseline -> candidate", ""]
    lines += _table(["cell", "baseline", "candidate", "change"],
                    [[cell_label(c.cell), c.old.value if c.old else "-", c.new.value if c.new else "-", c.change]
                     for c in s.changes]) + [""]
    if s.deltas:
        lines += ["## Metric deltas", ""]
        lines += _table(["cell", "check", "metric", "baseline", "candidate", "delta", "unit"],
                        [[cell_label(d.cell), d.check, d.metric, num(d.old), num(d.new),
                          multiple_delta(d.old, d.new), d.unit] for d in s.deltas]) + [""]
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
    lines += ["## Provenance", ""]
    base = dict(provenance_rows(s.baseline))
    rows = [[k, base.get(k, "-"), v] for k, v in provenance_rows(s.candidate)]
    rows.append(["injected faults", faults(s.baseline), faults(s.candidate)])
    lines += _table(["", "baseline", "candidate"], rows) + [""]
    lines += ["## Skipped or unavailable checks", ""]
    lines += ([f"- {md_escape(cell_label(u.cell))} {md_escape(u.check)}: {md_escape(u.reason)}" for u in s.unchecked]
              or ["- none: every check ran"]) + [""]
    return "\n".join(lines)


def write_signoff(out_dir: Path, s: Signoff) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    html, md = out_dir / HTML_FILE, out_dir / MD_FILE
    html.write_text(render_html(s), encoding="utf-8")
    md.write_text(render_markdown(s), encoding="utf-8")
    return {"html": html, "markdown": md}
