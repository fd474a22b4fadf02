"""Views of a cell's `details` for the HTML drill-down: what the report reads, and how.

`details` is JSON written by the compare stage. Every section is optional: a section whose key is
absent renders nothing. Keys read (anything else is ignored):

  layout        {"planned": {"ranks": [RANK, ...]}, "actual": {"ranks": [RANK, ...], "pool": {...}}}
                actual RANK: layout.json's rank report as the check read it (harness/records/rankreport.py, the
                schema), planned RANK: the planner's (layout.RankLayout.to_dict). Shown as any JSON
                object, so results of any age and malformed ones render: "rank", "q_heads", "kv_heads",
                "dcp_group", "dcp_rank", "kv_tp_rank", "q_to_kv", keys containing "pool" or "bytes" (e.g.
                "kv_pool_bytes", "kv_pool_blocks"), keys containing "checksum" (a hex string, or a list or
                {kv head: hex} of them; shown as 8-digit prefixes). Columns: the keys above that any rank
                has, plus any other key whose actual value differs from the planned one. Ranks are matched
                by "rank" (else by position). The scalars of actual.pool (or planned.pool) are listed under the table.
  speculator_layout  like layout, for the draft/MTP model (plain TP layout).
  prompts       [{"index", "prompt", "prefill": {metric: value}, "decode": {metric: value},
                  "generation": {"ref_text", "par_text", "first_divergence": int | null,
                  "benign": bool, "ref_token", "par_token", "ref_token_id", "par_token_id", "context_ref",
                  "context_par", "prompt_tail", "ref_topk"/"par_topk": [{"id", "token", "logprob"}]}}]
                context_*: a string, or {"before", "token", "after"} (the token is highlighted).
                Tokens show escaped with their id: "' Paris' <id 12>", "<id 285>" for an empty one.
  layer_errors  {"error": [...], "noise": [...] | null, "threshold": [...] | number}, one entry per
                hidden index as in artifacts' hidden.{i}: 0 = embedding output, i = output of layer i-1.
  head_errors   {"error": [[per head] per layer], "threshold": number | [per layer] | [[...]],
                 "owner_ranks": [rank | [ranks] per head], "kv_heads": [KV head id per head]}
  speculator    {"histogram": [steps per accepted length 0..k], "reference_histogram": [...],
                 "first_divergence": {"prompt", "step", "position", "reference"/"parallel": {"accepted",
                 "proposed", "committed"}} (one line of text), "baseline_key": {...} (not shown),
                 "layout": {like layout}, and scalars such as "kind", "k", "mean_acceptance",
                 "reference_mean_acceptance" (shown as a table)}
  gsm8k         {scalars such as "task", "score", "n", "answer_agreement", "generation_agreement",
                 "p_value" (nested objects such as "scores": {filter: score} show as scores.filter);
                 "baseline": {scalars: "score", "n", "stderr", "threshold", "alpha", "beta", "sigma",
                 "min_detectable_drop", ...}; "flips": [{"index", "question", "target", "ref_answer",
                 "par_answer", ...}] (any keys; one table column per key)}
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from markupsafe import Markup

from harness.core.details import divergence_text
from harness.core.fmt import human_bytes
from harness.report.matrix import format_number, is_scalar, metrics_text
from harness.report.svg import acceptance_bars

MAX_TABLE_ROWS = 200
_PROMPT_SKIP = ("index", "prompt", "offset")
_PROMPT_FIRST = ("max_kl", "max_abs", "top1_agreement", "first_diverging_position", "problem")
# the per-prompt table's metric columns: (metric key, header, unit)
PROMPT_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("max_kl", "max KL", "nats"), ("mean_kl", "mean KL", "nats"), ("max_abs", "max |\u0394 logit|", "logit"),
    ("top1_agreement", "top-1 agree", "fraction"), ("topk_overlap", "top-k overlap", "fraction"),
    ("first_diverging_position", "first diverging", "position"), ("problem", "problem", ""))
_POOL_PLAN_KEYS = (("kv_pool_blocks", "blocks"), ("kv_pool_bytes", "pool_bytes"))
_LAYOUT_FIRST = ("q_heads", "kv_heads", "dcp_group", "dcp_rank", "kv_tp_rank", "q_to_kv", "q_to_local_kv")


@dataclass(frozen=True)
class LayoutCell:
    text: str
    title: str
    mismatch: bool


@dataclass(frozen=True)
class LayoutRow:
    rank: str
    cells: tuple[LayoutCell, ...]
    mismatch: bool


@dataclass(frozen=True)
class LayoutView:
    columns: tuple[str, ...]
    rows: tuple[LayoutRow, ...]
    source: str
    mismatches: int
    pool: tuple[str, ...]


@dataclass(frozen=True)
class Context:
    before: str
    token: str
    after: str


@dataclass(frozen=True)
class Metrics:
    """The per-prompt metrics of one path: PROMPT_COLUMNS' values (formatted; '' where absent), and
    every metric in the tooltip."""

    values: tuple[str, ...]
    title: str

    @property
    def present(self) -> bool:
        return any(self.values)


@dataclass(frozen=True)
class TopkRow:
    rank: int
    ref: str
    ref_logprob: str
    ref_chosen: bool
    par: str
    par_logprob: str
    par_chosen: bool


@dataclass(frozen=True)
class PromptView:
    index: str
    prompt: str
    prefill: Metrics
    decode: Metrics
    generation: str
    diverged: bool
    benign: bool
    ref_token: str
    par_token: str
    token_ids: str
    context_ref: Context | None
    context_par: Context | None
    ref_text: str
    par_text: str
    prompt_tail: str = ""
    topk: tuple[TopkRow, ...] = ()


@dataclass(frozen=True)
class TableView:
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    omitted: int


@dataclass(frozen=True)
class Facts:
    items: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class SpeculatorView:
    facts: Facts
    layout: LayoutView | None
    histogram: Markup | None
    divergence: str = ""  # the first verify step whose accept count differs from the reference's


@dataclass(frozen=True)
class Gsm8kView:
    facts: Facts              # what matters, labelled with units (GSM8K_FACTS)
    baseline: Facts | None    # the gate's numbers (GATE_FACTS)
    flips: TableView | None   # one row per question whose answers differ (or whose correctness flipped)
    flip_count: int
    everything: Facts | None = None  # every scalar, collapsed under the tables
    power: str = ""           # the gate's reason when it has no or too little power


# (key, label): the GSM8K numbers worth reading; the rest stays in `everything`
GSM8K_FACTS: tuple[tuple[str, str], ...] = (
    ("score", "score (fraction correct)"), ("reference_score", "reference score"), ("n", "questions"),
    ("answer_agreement", "answers equal to the reference's (fraction)"),
    ("generation_agreement", "generations identical (fraction)"), ("b", "right -> wrong"), ("c", "wrong -> right"),
    ("p_value", "McNemar p"), ("questions_per_min", "questions / min"))
GATE_FACTS: tuple[tuple[str, str], ...] = (
    ("verdict", "gate verdict"), ("measured", "measured score"), ("ref_score", "baseline score"),
    ("threshold", "fails below"), ("min_detectable_drop", "smallest drop detected (power 1 - beta)"),
    ("detect_drop", "drop the suite asks to detect"), ("n", "questions"), ("alpha", "alpha (false alarms)"),
    ("beta", "beta (misses)"), ("sigma", "sigma"))
_FLIP_COLUMNS: tuple[tuple[str, str], ...] = (("index", "#"), ("question", "question"),
                                              ("ref_answer", "reference answer"), ("par_answer", "parallel answer"),
                                              ("target", "gold"))


def _dict(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"{what} is {type(value).__name__}, not an object")
    return value


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise TypeError(f"{what} is {type(value).__name__}, not a list")
    return value


def facts(data: dict[str, Any], skip: tuple[str, ...] = ()) -> Facts:
    """The scalar entries of an object, and those of its nested objects as 'outer.inner', formatted."""
    items: list[tuple[str, str]] = []
    for key, value in data.items():
        if key in skip:
            continue
        if isinstance(value, dict):
            items += [(f"{key}.{k}", format_number(v)) for k, v in value.items() if is_scalar(v)]
        elif is_scalar(value):
            items.append((key, format_number(value)))
    return Facts(tuple(items))


def _compact(value: Any) -> str:
    if is_scalar(value) or isinstance(value, list) and all(isinstance(v, int) for v in value):
        return format_number(value)
    text = json.dumps(value, default=str)
    return text if len(text) <= 120 else text[:117] + "..."


def table_view(records: Any, what: str) -> TableView | None:
    """A list of objects as a table; columns in order of first appearance."""
    rows = [_dict(r, f"{what}[{i}]") for i, r in enumerate(_list(records, what))]
    if not rows:
        return None
    columns = tuple(dict.fromkeys(k for r in rows for k in r))
    shown = rows[:MAX_TABLE_ROWS]
    return TableView(columns=columns, rows=tuple(tuple(_compact(r.get(c)) if c in r else "" for c in columns)
                                                 for r in shown), omitted=len(rows) - len(shown))


def _checksum_text(value: Any) -> str:
    if isinstance(value, str):
        return value[:8]
    if isinstance(value, list):
        return ",".join(_checksum_text(v) for v in value)
    if isinstance(value, dict):
        return " ".join(f"{k}:{_checksum_text(v)}" for k, v in value.items())
    return format_number(value)


def _layout_text(key: str, value: Any) -> tuple[str, str]:
    """(shown text, full text for the tooltip) of one layout value."""
    if "_to_" in key and isinstance(value, list):  # a per-head mapping: always one entry per head
        full = ",".join(str(v) for v in value)
        return full, full
    full = _compact(value)
    if "checksum" in key:
        return _checksum_text(value), full
    if "bytes" in key and isinstance(value, int) and not isinstance(value, bool):
        return human_bytes(value), f"{value} bytes"
    return full, full


def _ranks(section: Any, what: str) -> dict[Any, dict[str, Any]]:
    if section is None:
        return {}
    ranks = _list(_dict(section, what).get("ranks", []), f"{what}.ranks")
    out: dict[Any, dict[str, Any]] = {}
    for i, r in enumerate(ranks):
        row = _dict(r, f"{what}.ranks[{i}]")
        out[row.get("rank", i)] = row
    return out


def _differs(planned: dict[str, Any] | None, actual: dict[str, Any] | None, key: str) -> bool:
    """Both sides have the key and disagree on it."""
    return planned is not None and actual is not None and key in planned and key in actual \
        and planned[key] != actual[key]


def layout_view(data: Any, pool_expected: dict[str, Any] | None = None) -> LayoutView | None:
    """Per-rank layout, actual against planned; mismatching values highlighted. `pool_expected` (the
    layout check's expected pool: "blocks", "pool_bytes") is the plan's kv_pool_blocks/kv_pool_bytes."""
    section = _dict(data, "layout")
    planned, actual = _ranks(section.get("planned"), "planned"), _ranks(section.get("actual"), "actual")
    if pool_expected is not None:
        planned_pool = {key: pool_expected[src] for key, src in _POOL_PLAN_KEYS if src in pool_expected}
        planned = {r: {**planned_pool, **row} for r, row in planned.items()}
    if not planned and not actual:
        return None
    source = "actual vs planned" if planned and actual else "planned only" if planned else "actual only"
    ranks = list(dict.fromkeys([*actual, *planned]))
    keys = list(dict.fromkeys(k for rows in (actual, planned) for r in rows.values() for k in r))
    differs = {k for r in ranks for k in keys if _differs(planned.get(r), actual.get(r), k)}
    columns = [k for k in _LAYOUT_FIRST if k in keys]
    columns += [k for k in keys if ("pool" in k or "bytes" in k) and k not in columns]
    columns += [k for k in keys if "checksum" in k and k not in columns]
    columns += [k for k in keys if k in differs and k not in columns and k != "rank"]
    rows = []
    for r in ranks:
        shown = actual.get(r, planned.get(r, {}))
        cells = []
        for k in columns:
            text, title = _layout_text(k, shown[k]) if k in shown else ("", "")
            bad = _differs(planned.get(r), actual.get(r), k)
            if bad:
                plan_text, plan_full = _layout_text(k, planned[r][k])
                text, title = f"{text} (plan {plan_text})", f"actual {title}; planned {plan_full}"
            cells.append(LayoutCell(text=text, title=title, mismatch=bad))
        rows.append(LayoutRow(rank=format_number(r), cells=tuple(cells), mismatch=any(c.mismatch for c in cells)))
    return LayoutView(columns=tuple(columns), rows=tuple(rows), source=source,
                      mismatches=sum(c.mismatch for row in rows for c in row.cells), pool=_pool(section))


def _pool(section: dict[str, Any]) -> tuple[str, ...]:
    """'name=value' of the pool object of the actual layout, else of the planned one."""
    for side in ("actual", "planned"):
        part = section.get(side)
        pool = part.get("pool") if isinstance(part, dict) else None
        if isinstance(pool, dict):
            return tuple(f"{k}={_layout_text(k, v)[0]}" for k, v in pool.items() if is_scalar(v))
    return ()


def _context(value: Any, token_id: Any = None) -> Context | None:
    if isinstance(value, str):
        return Context(before=shown(value), token="", after="")
    if isinstance(value, dict):  # the highlighted token escaped: an empty or U+FFFD token stays visible
        token = value.get("token")
        text = token_text(token, token_id) if isinstance(token, str) else ""
        return Context(before=shown(str(value.get("before", ""))), token=text, after=shown(str(value.get("after", ""))))
    return None


def _escape(ch: str) -> str:
    return f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}"


def shown(text: str) -> str:
    """Running text with the characters that would not show escaped (control and format characters,
    U+FFFD); newlines, tabs and spaces kept."""
    return "".join(ch if ch in "\n\t " or (ch.isprintable() and ch != "\ufffd") else _escape(ch) for ch in text)


def printable(text: str) -> bool:
    """Every character shows as itself (no control, format or U+FFFD characters, no whitespace but ' ')."""
    return all(ch == " " or (ch.isprintable() and ch != "\ufffd") for ch in text)


def token_text(text: str | None, token_id: Any) -> str:
    """A token as read in the report: its quoted, escaped text and '<id N>' (U+27E8/9 brackets); only
    the id where the text is empty, the end of text for None."""
    tag = f"\u27e8id {format_number(token_id)}\u27e9" if token_id is not None else ""
    if text is None:
        return "(end of text)"
    if text == "" and tag:
        return tag
    return f"{visible(text)} {tag}".rstrip()


def visible(text: str) -> str:
    """Text quoted with every invisible or ambiguous character escaped: whitespace other than the
    space, control and format characters, and U+FFFD (a token that is part of a UTF-8 sequence
    decodes to it), so two different tokens never look alike."""
    out = []
    for ch in text:
        if ch in "\\'":
            out.append("\\" + ch)
        elif ch == " " or (ch.isprintable() and ch != "\ufffd"):
            out.append(ch)
        elif ch in "\n\t\r":
            out.append({"\n": "\\n", "\t": "\\t", "\r": "\\r"}[ch])
        else:
            out.append(_escape(ch))
    return "'" + "".join(out) + "'"


def _token(value: Any, token_id: Any, diverged: bool) -> str:
    """A diverging token: its escaped text and its id ("'\\ufffd' <id 210>", "<id 285>"); None is
    the end of the text."""
    if value is None:
        return "(end of text)" if diverged else ""
    return token_text(value if isinstance(value, str) else str(value), token_id)


def _topk(gen: dict[str, Any]) -> tuple[TopkRow, ...]:
    """Both runs' top-k at the first divergence side by side, each run's own token marked."""
    ref, par = gen.get("ref_topk") or [], gen.get("par_topk") or []

    def side(entries: list[Any], k: int, chosen: Any) -> tuple[str, str, bool]:
        if k >= len(entries):
            return "", "", False
        e = _dict(entries[k], "topk entry")
        text = e.get("token")
        return (token_text(text if isinstance(text, str) else None, e.get("id")), format_number(e.get("logprob")),
                e.get("id") == chosen)
    rows = []
    for k in range(max(len(_list(ref, "ref_topk")), len(_list(par, "par_topk")))):
        r, p = side(ref, k, gen.get("ref_token_id")), side(par, k, gen.get("par_token_id"))
        rows.append(TopkRow(rank=k + 1, ref=r[0], ref_logprob=r[1], ref_chosen=r[2], par=p[0], par_logprob=p[1],
                            par_chosen=p[2]))
    return tuple(rows)


def _generation_text(gen: dict[str, Any]) -> tuple[str, bool, bool]:
    """(one-line outcome, diverged, benign)."""
    if not gen:
        return "", False, False
    first = gen.get("first_divergence")
    benign = gen.get("benign") is True
    if first is None:
        return "identical", False, False
    return f"diverges at token {format_number(first)}" + (" (benign near-tie)" if benign else ""), True, benign


def _token_ids(ref: Any, par: Any) -> str:
    """'ref 17 vs par 42' when the generation names the diverging token ids."""
    if ref is None and par is None:
        return ""
    return f"ref {format_number(ref)} vs par {format_number(par)}"


def _metrics(value: Any, what: str) -> Metrics:
    data = _dict(value or {}, what)
    ordered = {**{k: data[k] for k in _PROMPT_FIRST if k in data}, **data}
    items = metrics_text(ordered, skip=_PROMPT_SKIP)
    values = tuple(format_number(data[k]) if data.get(k) is not None else "" for k, _, _ in PROMPT_COLUMNS)
    return Metrics(values=values, title="\n".join(items))


def _prompt_view(i: int, raw: Any) -> PromptView:
    p = _dict(raw, f"prompts[{i}]")
    gen = _dict(p.get("generation") or {}, f"prompts[{i}].generation")
    outcome, diverged, benign = _generation_text(gen)
    return PromptView(index=format_number(p.get("index", i)), prompt=str(p.get("prompt", "")),
                      prefill=_metrics(p.get("prefill"), f"prompts[{i}].prefill"),
                      decode=_metrics(p.get("decode"), f"prompts[{i}].decode"),
                      generation=outcome, diverged=diverged, benign=benign,
                      ref_token=_token(gen.get("ref_token"), gen.get("ref_token_id"), diverged),
                      par_token=_token(gen.get("par_token"), gen.get("par_token_id"), diverged),
                      token_ids=_token_ids(gen.get("ref_token_id"), gen.get("par_token_id")),
                      context_ref=_context(gen.get("context_ref"), gen.get("ref_token_id")),
                      context_par=_context(gen.get("context_par"), gen.get("par_token_id")),
                      ref_text=shown(str(gen.get("ref_text", ""))), par_text=shown(str(gen.get("par_text", ""))),
                      prompt_tail=shown(str(gen.get("prompt_tail") or "")), topk=_topk(gen))


def prompts_view(data: Any) -> tuple[PromptView, ...] | None:
    views = tuple(_prompt_view(i, p) for i, p in enumerate(_list(data, "prompts")))
    return views or None


def speculator_view(data: Any) -> SpeculatorView | None:
    section = _dict(data, "speculator")
    layout = section.get("layout")
    first = section.get("first_divergence")
    view = SpeculatorView(facts=facts(section, skip=("first_divergence", "baseline_key")),
                          layout=layout_view(layout) if layout is not None else None,
                          histogram=acceptance_bars(section.get("histogram"), section.get("reference_histogram")),
                          divergence=divergence_text(_dict(first, "speculator.first_divergence")) if first else "")
    return view if view.facts.items or view.layout or view.histogram else None


def _picked(data: dict[str, Any], keys: tuple[tuple[str, str], ...]) -> Facts:
    return Facts(tuple((label, format_number(data[k])) for k, label in keys if is_scalar(data.get(k))
                       and data.get(k) is not None))


def _answers_table(records: list[Any]) -> TableView | None:
    """Questions whose answers differ: question, both answers, gold, and how correctness changed."""
    rows = []
    for i, raw in enumerate(records[:MAX_TABLE_ROWS]):
        r = _dict(raw, f"gsm8k.disagreements[{i}]")
        change = {(True, False): "right -> wrong", (False, True): "wrong -> right"}.get(
            (r.get("ref_correct"), r.get("par_correct")), "both right" if r.get("ref_correct") else "both wrong")
        rows.append((*(_compact(r.get(k)) if k != "question" else str(r.get(k, "")) for k, _ in _FLIP_COLUMNS),
                     change))
    if not rows:
        return None
    return TableView(columns=(*(label for _, label in _FLIP_COLUMNS), "change"), rows=tuple(rows),
                     omitted=len(records) - len(rows))


def gsm8k_view(data: Any) -> Gsm8kView | None:
    section = _dict(data, "gsm8k")
    baseline = section.get("baseline")
    records = section.get("disagreements", section.get("flips"))
    gate = _dict(baseline, "gsm8k.baseline") if baseline is not None else None
    reason = str(gate.get("reason", "")) if gate else ""
    power = reason if gate and gate.get("verdict") in ("SKIP", "WARN") and "detect" in reason else ""
    everything = facts(section, skip=("baseline", "flips", "disagreements"))
    view = Gsm8kView(facts=_picked(section, GSM8K_FACTS), baseline=_picked(gate, GATE_FACTS) if gate else None,
                     flips=_answers_table(_list(records, "gsm8k.disagreements")) if records is not None else None,
                     flip_count=len(records) if isinstance(records, list) else 0,
                     everything=everything if everything.items else None, power=power)
    return view if view.facts.items or view.baseline or view.flips or view.everything else None
