"""index.html: one self-contained page (inline CSS and SVG, no script, no URL), all user text escaped.

The first screen answers "can I ship this build?": the headline, a silent-corruption banner naming
cells and suspects, the matrix (cell x check, coloured by verdict, key number, reason on hover; in a
scroll container whose cell column stays put; filters "failing only" and "one check" done in CSS
with :has(), no script) and the provenance. Each matrix cell links to its check's row in the cell's
drill-down (a browser opens the <details> around a fragment's target). Below it, one <details>
drill-down per cell (see details.py for the data it reads); per-layer plots and head heat maps are
drawn only for cells that did not pass (results.json keeps the numbers of every cell).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from jinja2 import Environment, FileSystemLoader, StrictUndefined
from markupsafe import Markup

from harness import __version__
from harness.core.checkmetrics import noise_multiples
from harness.core.details import CellDetails
from harness.core.fmt import multiple
from harness.core.jsonio import write_text_atomic
from harness.core.verdict import CellResult, CheckResult, FailureClass, Verdict
from harness.records.results import summary_counts
from harness.report.details import (
    PROMPT_COLUMNS,
    Gsm8kView,
    LayoutView,
    PromptView,
    SpeculatorView,
    gsm8k_view,
    layout_view,
    prompts_view,
    speculator_view,
)
from harness.report.history_strip import HistoryView, cell_id, history_view
from harness.report.logs import clean_log, xml_safe
from harness.report.matrix import (
    Matrix,
    MatrixRow,
    build_matrix,
    check_anchor,
    class_label,
    format_number,
    headline,
    interrupted_text,
    is_scalar,
    key_legend,
    key_number,
    localization_text,
    provenance_items,
    suspect_text,
)
from harness.report.requests_view import RequestsView, requests_view
from harness.report.svg import head_heatmap, layer_error_plot, p_value_strip

if TYPE_CHECKING:
    from harness.records.history import CellHistory, TrendKey

HTML_FILE = "index.html"
TEMPLATES_DIR = Path(__file__).resolve().parent / "templates"
# details written by another harness version may not have the shape this one expects: such a
# section is replaced by a one-line note instead of breaking the whole report.
_MALFORMED = (KeyError, TypeError, ValueError, IndexError, AttributeError, ZeroDivisionError)
T = TypeVar("T")


@dataclass(frozen=True)
class BannerItem:
    label: str
    anchor: str
    failed: str
    suspect: str


U_UNIT = "u: unit roundoff of the model dtype (2^-8 bf16, 2^-11 fp16, 2^-24 fp32)"
# what a metric is measured in, by the first fragment of its name that matches
_UNITS: tuple[tuple[str, str], ...] = (
    ("/noise", "x noise floor"), ("fraction_of_bound", "fraction of bound"), ("kl", "nats"), ("abs", "logit"),
    ("agreement", "fraction"), ("overlap", "fraction"), ("score", "fraction correct"), ("p_value", "probability"),
    ("wall_s", "s"), ("bytes", "bytes"), ("positions", "positions"), ("position", "token index"),
    ("tokens", "tokens"), ("gap", "nats"),
    ("prompts", "prompts"), ("questions_per_min", "questions / min"))


def metric_unit(check: str, name: str) -> str:
    """The unit of a check's metric ('' when it is a count or unitless)."""
    if check == "collectives" and ("error" in name or "bound" in name) and "fraction" not in name:
        return "u"
    return next((unit for fragment, unit in _UNITS if fragment in name), "")


@dataclass(frozen=True)
class MetricRow:
    name: str
    value: str
    unit: str


@dataclass(frozen=True)
class CheckView:
    """One check in the drill-down: its scalar metrics as a table with units, and its lists of text
    (e.g. every problem)."""

    check: CheckResult
    key: str
    metrics: tuple[MetricRow, ...]
    lists: tuple[tuple[str, tuple[str, ...]], ...]
    anchor: str = ""
    chart: Markup | None = None  # a sampled cell's per-position p-value strip (sampling_distribution)
    outside_support: int | None = None  # ... and its count of tokens drawn outside the reference's support

    @property
    def uses_u(self) -> bool:
        return self.check.name == "collectives" or any(m.unit == "u" for m in self.metrics)


def metric_rows(check: CheckResult) -> tuple[MetricRow, ...]:
    """Noise multiples first ('max_kl / noise'), then every scalar and nested scalar ('kl_bound.limit')."""
    rows = [MetricRow(f"{name} / noise", multiple(value), "x noise floor") for name, value in
            noise_multiples(check).items()]
    for key, value in check.metrics.items():
        if key == "headline":
            continue
        if isinstance(value, dict):
            rows += [MetricRow(f"{key}.{k}", format_number(v), metric_unit(check.name, key if k != "factor" else ""))
                     for k, v in value.items() if v is not None and is_scalar(v)]
        elif value is not None and is_scalar(value):
            rows.append(MetricRow(key, format_number(value), metric_unit(check.name, key)))
    return tuple(rows)


def check_view(check: CheckResult, row_index: int = 0) -> CheckView:
    lists = tuple((name, tuple(str(v) for v in value)) for name, value in check.metrics.items()
                  if isinstance(value, list) and value and all(isinstance(v, str) for v in value))
    chart, outside = None, None
    if check.name == "sampling_distribution":
        try:
            chart = p_value_strip(check.metrics)
        except _MALFORMED:  # metrics of another harness version: the table still shows them
            chart = None
        value = check.metrics.get("outside_support")
        outside = value if isinstance(value, int) and not isinstance(value, bool) else None
    return CheckView(check=check, key=key_number(check), metrics=metric_rows(check), lists=lists,
                     anchor=check_anchor(row_index, check.name), chart=chart, outside_support=outside)


@dataclass(frozen=True)
class CellView:
    row: MatrixRow
    checks: tuple[CheckView, ...]
    anchor: str
    expanded: bool
    first_problem: str
    localization: str
    layout: LayoutView | None
    speculator_layout: LayoutView | None
    prompts: tuple[PromptView, ...] | None
    layer_plot: Markup | None
    head_map: Markup | None
    speculator: SpeculatorView | None
    gsm8k: Gsm8kView | None
    notes: tuple[str, ...]
    requests: RequestsView | None = None
    prompt_columns: tuple[tuple[int, str, str], ...] = ()  # (index into Metrics.values, header, unit)
    layout_problems: int | None = None  # the layout check's problem count, next to the table's own count
    plots_omitted: bool = False

    @property
    def uses_u(self) -> bool:
        return any(c.uses_u for c in self.checks)


def _section(details: dict[str, Any], key: str, build: Callable[[Any], T | None], notes: list[str]) -> T | None:
    """build(details[key]); None when the key is absent, a note when its data is malformed."""
    data = details.get(key)
    if data is None:
        return None
    try:
        return build(data)
    except _MALFORMED as exc:
        notes.append(f"details[{key!r}] could not be shown ({type(exc).__name__}: {exc})")
        return None


def _object(data: Any) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise TypeError(f"expected an object, got {type(data).__name__}")
    return data


def _anchor(row: MatrixRow) -> str:
    return f"cell-{row.index}"


def _first_problem(cell: CellResult) -> str:
    for verdict in (Verdict.FAIL, Verdict.ERROR, Verdict.WARN, Verdict.SKIP):
        for check in cell.checks:
            if check.verdict is verdict:
                return f"{check.name}: {check.reason}"
    return "" if cell.checks else "no checks ran"


def _pool_expected(cell: CellResult, check_name: str) -> dict[str, Any] | None:
    """The KV pool the layout check expected (its metrics' pool_expected), for the planned side."""
    for check in cell.checks:
        if check.name == check_name and isinstance(check.metrics.get("pool_expected"), dict):
            return dict(check.metrics["pool_expected"])
    return None


def cell_view(row: MatrixRow) -> CellView:
    cell = row.cell
    notes: list[str] = []
    details = cell.details if isinstance(cell.details, dict) else {}
    try:  # the schema compare writes (harness/core/details.py): drift shows as a note, never a crash
        CellDetails.from_dict(details)
    except (TypeError, ValueError) as exc:
        notes.append(f"details do not match harness/core/details.py ({exc})")
    loc = cell.localization
    heads = loc.heads if loc else ()
    heavy = cell.status not in (Verdict.PASS, Verdict.SKIP)  # plots only where someone will read them
    prompts = _section(details, "prompts", prompts_view, notes)
    columns = tuple((i, header, unit) for i, (_, header, unit) in enumerate(PROMPT_COLUMNS)
                    if prompts and any(m.values[i] for p in prompts for m in (p.prefill, p.decode)))
    return CellView(
        row=row, checks=tuple(check_view(c, row.index) for c in cell.checks), anchor=_anchor(row),
        expanded=cell.status in (Verdict.FAIL, Verdict.ERROR),
        first_problem=_first_problem(cell), localization=localization_text(loc) if loc else "",
        layout=_section(details, "layout", lambda d: layout_view(d, _pool_expected(cell, "layout")), notes),
        speculator_layout=_section(details, "speculator_layout",
                                   lambda d: layout_view(d, _pool_expected(cell, "speculator_layout")), notes),
        prompts=prompts,
        layer_plot=_section(details, "layer_errors", lambda d: layer_error_plot(_object(d), loc.layer if loc else None),
                            notes) if heavy else None,
        head_map=_section(details, "head_errors", lambda d: head_heatmap(_object(d), heads), notes) if heavy else None,
        speculator=_section(details, "speculator", speculator_view, notes),
        gsm8k=_section(details, "gsm8k", gsm8k_view, notes),
        requests=_section(details, "requests", requests_view, notes),
        notes=tuple(notes), prompt_columns=columns, layout_problems=_problem_count(cell, "layout"),
        plots_omitted=not heavy and ("layer_errors" in details or "head_errors" in details))


def _problem_count(cell: CellResult, check_name: str) -> int | None:
    for check in cell.checks:
        if check.name == check_name and isinstance(check.metrics.get("problems"), list):
            return len(check.metrics["problems"])
    return None


def banner_items(matrix: Matrix, performance: bool = False) -> list[BannerItem]:
    """The silent-corruption cells (or, with `performance`, the performance-only ones) with their failed
    checks and suspects."""
    items = []
    for row in matrix.rows:
        cell = row.cell
        if not (cell.failure_class is FailureClass.PERFORMANCE if performance else cell.silent_corruption):
            continue
        failed = ", ".join(c.name for c in cell.checks if c.verdict is Verdict.FAIL)
        items.append(BannerItem(label=row.label, anchor=_anchor(row), failed=failed, suspect=suspect_text(cell)))
    return items


def _sources(provenance: dict[str, Any]) -> list[str]:
    sources = provenance.get("sources")
    if not isinstance(sources, list):
        return []
    return [f"{s.get('run_id', '?')} ({s.get('dir', '?')})" for s in sources if isinstance(s, dict)]


def _printable(value: Any) -> Any:
    """Every printed string without control characters (generated text can hold any byte)."""
    return xml_safe(value) if isinstance(value, str) and not isinstance(value, Markup) else value


def breakable(name: str) -> Markup:
    """A check name that may wrap after its underscores (short matrix headers)."""
    return Markup("_<wbr>").join(Markup.escape(part) for part in name.split("_"))


def _environment() -> Environment:
    env = Environment(loader=FileSystemLoader(str(TEMPLATES_DIR)), autoescape=True, undefined=StrictUndefined,
                      trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True, finalize=_printable)
    env.globals.update(clean_log=clean_log, breakable=breakable)
    return env


def history_views(matrix: Matrix, histories: "dict[TrendKey, CellHistory] | None"
                  ) -> tuple[dict[str, HistoryView], list[tuple[str, str, str]]]:
    """Per cell anchor its history view, and the flaky cells as (label, anchor, flips text)."""
    views = {_anchor(r): history_view(histories[cell_id(r.cell)]) for r in matrix.rows
             if histories and cell_id(r.cell) in histories}
    flaky = [(r.label, _anchor(r), views[_anchor(r)].flaky) for r in matrix.rows
             if _anchor(r) in views and views[_anchor(r)].flaky]
    return views, flaky


def render_html(cells: list[CellResult], provenance: dict[str, Any], run_id: str,
                histories: "dict[TrendKey, CellHistory] | None" = None) -> str:
    matrix = build_matrix(cells)
    views = [cell_view(r) for r in matrix.rows]
    history, flaky = history_views(matrix, histories)
    problems = [v for v in views if v.row.cell.status in (Verdict.FAIL, Verdict.ERROR)
                and not v.row.cell.silent_corruption and v.row.cell.failure_class is not FailureClass.PERFORMANCE]
    skipped = [v for v in views if v.row.cell.status is Verdict.SKIP]
    page = _environment().get_template("index.html.j2").render(
        run_id=run_id, head=headline(cells, interrupted_text(provenance)), counts=summary_counts(cells),
        verdicts=list(Verdict),
        matrix=matrix, banner=banner_items(matrix), performance=banner_items(matrix, performance=True),
        problems=problems, class_label=class_label, skipped=skipped, cells=views,
        legend=key_legend(cells), u_unit=U_UNIT,
        provenance=provenance_items(provenance), command=str(provenance.get("command", "")),
        sources=_sources(provenance), harness_version=__version__, history=history, flaky=flaky,
        rendered=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    # No URL of any kind in the file: user text that holds one (a prompt quoting a link) keeps its
    # look, since the entity renders as '/', but the source never contains '://'.
    return page.replace("://", ":&#47;&#47;")


def write_html(out_dir: Path, cells: list[CellResult], provenance: dict[str, Any], run_id: str,
               histories: "dict[TrendKey, CellHistory] | None" = None) -> Path:
    path = out_dir / HTML_FILE
    write_text_atomic(path, render_html(cells, provenance, run_id, histories))
    return path
