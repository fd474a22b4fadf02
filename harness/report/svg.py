"""Inline SVG charts for the HTML report: per-layer error plot, per-head heat map, acceptance bars, a sampled
cell's per-position p-value strip.

Every function returns escaped markup (no xmlns, no external reference) or None when there is
nothing to draw. Styles are SVG presentation attributes (see _STYLES), so a chart looks the same
wherever it is pasted, with or without the page's CSS.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

from markupsafe import Markup, escape

from harness.core.fmt import id_ranges
from harness.report.matrix import format_number

_W, _H = 560, 220
_ML, _MR, _MT, _MB = 56, 12, 22, 30


_MONO = "ui-monospace, Menlo, Consolas, monospace"
_STYLES: dict[str, dict[str, Any]] = {
    "svg-grid": {"stroke": "#eaeef2", "stroke_width": 1},
    "svg-label": {"font_family": _MONO, "font_size": 10, "fill": "#57606a"},
    "svg-hl": {"fill": "#cf222e", "font_weight": 700},
    "svg-error": {"fill": "none", "stroke": "#0969da", "stroke_width": 2},
    "svg-noise": {"fill": "none", "stroke": "#8c959f", "stroke_width": 1.5, "stroke_dasharray": "4 3"},
    "svg-threshold": {"fill": "none", "stroke": "#cf222e", "stroke_width": 1.5},
    "svg-highlight": {"stroke": "#cf222e", "stroke_width": 1, "stroke_dasharray": "2 2"},
    "svg-point": {"fill": "#0969da"},
    "svg-over": {"fill": "#cf222e", "stroke": "#ffffff", "stroke_width": 1},
    "svg-cell": {"stroke": "#ffffff", "stroke_width": 0.5},
    "svg-cell-over": {"stroke": "#1f2328", "stroke_width": 1.2},
    "svg-bar": {"fill": "#0969da"},
    "svg-bar-ref": {"fill": "#afb8c1"},
}


def _el(tag: str, attrs: dict[str, Any], *children: str) -> str:
    """An element; a "class" entry becomes the presentation attributes of its _STYLES entries."""
    styled = dict(attrs)
    for cls in str(styled.pop("class", styled.pop("class_", ""))).split():
        styled.update(_STYLES[cls])
    text = "".join(f' {k.replace("_", "-")}="{escape(str(v))}"' for k, v in styled.items())
    return f"<{tag}{text}>{''.join(children)}</{tag}>"


def _title(text: str) -> str:
    return f"<title>{escape(text)}</title>"


def _text(x: float, y: float, text: str, **attrs: Any) -> str:
    return _el("text", {"x": f"{x:.1f}", "y": f"{y:.1f}", **attrs}, str(escape(text)))


def _svg(width: float, height: float, label: str, body: Iterable[str]) -> Markup:
    head = (f'<svg class="chart" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}" role="img" aria-label="{escape(label)}">')
    return Markup(head + "".join(body) + "</svg>")


def number(value: Any) -> float | None:
    """A JSON number as float (NaN and infinities kept); None for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _series(value: Any, length: int) -> list[float | None]:
    """A per-layer list, or one number repeated; [] when absent."""
    if isinstance(value, list):
        return [number(v) for v in value]
    scalar = number(value)
    return [scalar] * length if scalar is not None else []


def _at(values: list[float | None], i: int) -> float | None:
    return values[i] if i < len(values) else None


def _decades(values: Iterable[float | None]) -> tuple[int, int] | None:
    positive = [v for v in values if v is not None and math.isfinite(v) and v > 0]
    if not positive:
        return None
    lo, hi = math.floor(math.log10(min(positive))), math.ceil(math.log10(max(positive)))
    return lo, hi if hi > lo else lo + 1


def _hidden_name(index: int) -> str:
    """Hidden index 0 is the embedding output, index i the output of layer i-1."""
    return "emb" if index == 0 else str(index - 1)


def layer_error_plot(data: dict[str, Any], highlight_layer: int | None = None) -> Markup | None:
    """Hidden-state error per hidden index (log y) against the noise floor and the threshold line;
    highlight_layer (a layer number, -1 for the embedding) gets a dashed marker."""
    error = _series(data.get("error"), 0)
    if not error:
        return None
    n = len(error)
    noise, threshold = _series(data.get("noise"), n), _series(data.get("threshold"), n)
    span = _decades([*error, *noise, *threshold])
    if span is None:
        return None
    lo, hi = span
    plot_w, plot_h = _W - _ML - _MR, _H - _MT - _MB

    def x(i: int) -> float:
        return _ML + (i * plot_w / (n - 1) if n > 1 else plot_w / 2)

    def y(v: float) -> float:
        exp = hi if v == math.inf else lo if v <= 0 else min(max(math.log10(v), lo), hi)
        return _MT + (hi - exp) / (hi - lo) * plot_h

    body: list[str] = []
    step = max(1, math.ceil((hi - lo) / 6))
    for e in range(lo, hi + 1, step):
        body.append(_el("line", {"x1": _ML, "x2": _W - _MR, "y1": f"{y(10.0 ** e):.1f}", "y2": f"{y(10.0 ** e):.1f}",
                                 "class": "svg-grid"}))
        body.append(_text(_ML - 4, y(10.0 ** e) + 4, f"1e{e}", text_anchor="end", class_="svg-label"))
    xstep = max(1, math.ceil(n / 20))
    for i in range(0, n, xstep):
        body.append(_text(x(i), _H - _MB + 14, _hidden_name(i), text_anchor="middle", class_="svg-label"))
    body.append(_text(_ML + plot_w / 2, _H - 3, "output of layer", text_anchor="middle", class_="svg-label"))
    if highlight_layer is not None and 0 <= highlight_layer + 1 < n:
        hx = x(highlight_layer + 1)
        body.append(_el("line", {"x1": f"{hx:.1f}", "x2": f"{hx:.1f}", "y1": _MT, "y2": _MT + plot_h,
                                 "class": "svg-highlight"}, _title(f"first diverging layer {highlight_layer}")))
    for name, values in (("threshold", threshold), ("noise", noise), ("error", error)):
        body.append(_polyline(values, x, y, f"svg-{name}"))
    for i, v in enumerate(error):
        if v is None or math.isnan(v):
            continue
        thr = _at(threshold, i)
        over = thr is not None and v > thr
        where = "embedding" if i == 0 else f"layer {i - 1}"
        tip = (f"{where}: error={format_number(v)}, noise={format_number(_at(noise, i))}, "
               f"threshold={format_number(thr)}" + (" (over threshold)" if over else ""))
        body.append(_el("circle", {"cx": f"{x(i):.1f}", "cy": f"{y(v):.1f}", "r": 3.5 if over else 2.5,
                                   "class": "svg-over" if over else "svg-point"}, _title(tip)))
    legend = [("error", "svg-error"), ("noise floor", "svg-noise"), ("threshold", "svg-threshold")]
    for k, (label, cls) in enumerate(legend):
        lx = _ML + 8 + k * 110
        body.append(_el("line", {"x1": lx, "x2": lx + 18, "y1": 10, "y2": 10, "class": cls}))
        body.append(_text(lx + 22, 14, label, class_="svg-label"))
    return _svg(_W, _H, "per-layer error against the noise floor", body)


def _polyline(values: list[float | None], x: Any, y: Any, cls: str) -> str:
    """One line per run of plottable values (NaN and missing values break the line)."""
    runs: list[list[str]] = [[]]
    for i, v in enumerate(values):
        if v is None or math.isnan(v):
            runs.append([])
        else:
            runs[-1].append(f"{x(i):.1f},{y(v):.1f}")
    return "".join(_el("polyline", {"points": " ".join(r), "class": cls}) for r in runs if r)


def _heat_colour(ratio: float | None) -> str:
    """Blue shades below the threshold (ratio < 1), red shades above; black for NaN."""
    if ratio is None or math.isnan(ratio):
        return "#000000"
    if ratio <= 0:
        return "#f0f4f8"
    t = min(max(math.log10(ratio), -3.0), 3.0)
    if t < 0:
        return _lerp((0xf0, 0xf4, 0xf8), (0x6b, 0xae, 0xd6), (t + 3) / 3)
    return _lerp((0xfc, 0xae, 0x91), (0xa5, 0x0f, 0x15), t / 3)


def _lerp(a: tuple[int, int, int], b: tuple[int, int, int], t: float) -> str:
    return "#" + "".join(f"{round(p + (q - p) * t):02x}" for p, q in zip(a, b))


def _threshold_at(threshold: Any, layer: int, head: int) -> float | None:
    if isinstance(threshold, list):
        row = threshold[layer] if layer < len(threshold) else None
        return number(row[head] if head < len(row) else None) if isinstance(row, list) else number(row)
    return number(threshold)


def _owner_text(owner: Any) -> str:
    if isinstance(owner, list):
        return id_ranges(v for v in owner if isinstance(v, int))
    return "" if owner is None else str(owner)


def head_heatmap(data: dict[str, Any], highlight_heads: Iterable[int] = ()) -> Markup | None:
    """Layer x head error relative to the threshold, with each head's owning ranks and KV head."""
    rows = data.get("error")
    if not isinstance(rows, list) or not rows or not all(isinstance(r, list) for r in rows):
        return None
    n_layers, n_heads = len(rows), max(len(r) for r in rows)
    if n_heads == 0:
        return None
    threshold, hl = data.get("threshold"), set(highlight_heads)
    owners, kvs = data.get("owner_ranks") or [], data.get("kv_heads") or []
    finite = [v for r in rows for v in map(number, r) if v is not None and math.isfinite(v)]
    scale = max(finite, default=0.0) or 1.0
    cw = min(28.0, max(8.0, 520 / n_heads))
    ch = min(20.0, max(6.0, 320 / n_layers))
    left, top = 52.0, 20.0
    grid_h = ch * n_layers
    body: list[str] = [_text(4, 14, "error / threshold per layer and head", class_="svg-label")]
    for layer, row in enumerate(rows):
        ly = top + layer * ch
        if n_layers <= 40 or layer % math.ceil(n_layers / 40) == 0:
            body.append(_text(left - 4, ly + ch / 2 + 4, f"L{layer}", text_anchor="end", class_="svg-label"))
        for head in range(n_heads):
            value = number(row[head]) if head < len(row) else None
            thr = _threshold_at(threshold, layer, head)
            ratio = None if value is None else value / thr if thr else value / scale
            owner = _owner_text(owners[head]) if head < len(owners) else ""
            kv = str(kvs[head]) if head < len(kvs) else ""
            tip = (f"layer {layer} head {head}" + (f" (rank {owner}" if owner else " (")
                   + (f", kv head {kv})" if kv else ")") + f": error={format_number(value)}, "
                   f"threshold={format_number(thr)}" + ("" if ratio is None else f", ratio={format_number(ratio)}"))
            attrs = {"x": f"{left + head * cw:.1f}", "y": f"{ly:.1f}", "width": f"{cw:.1f}",
                     "height": f"{ch:.1f}", "fill": _heat_colour(ratio),
                     "class": "svg-cell-over" if ratio is not None and ratio > 1 else "svg-cell"}
            body.append(_el("rect", attrs, _title(tip)))
    label_step = max(1, math.ceil(14 / cw))
    for name, values, offset in (("head", list(range(n_heads)), 14), ("rank", owners, 28), ("kv", kvs, 42)):
        if not values and name != "head":
            continue
        body.append(_text(left - 4, top + grid_h + offset, name, text_anchor="end", class_="svg-label"))
        for head in range(0, min(n_heads, len(values)), label_step):
            text = str(head) if name == "head" else _owner_text(values[head])
            cls = "svg-label svg-hl" if head in hl else "svg-label"
            body.append(_text(left + head * cw + cw / 2, top + grid_h + offset, text, text_anchor="middle",
                              class_=cls))
    width = max(left + cw * n_heads + 12, 260)
    return _svg(width, top + grid_h + 50, "per-head error heat map", body)


def acceptance_bars(histogram: Any, reference: Any) -> Markup | None:
    """Share of decode steps per accepted length, this cell next to the reference topology."""
    series = [("this cell", "svg-bar", _counts(histogram)), ("reference", "svg-bar-ref", _counts(reference))]
    series = [s for s in series if s[2]]
    if not series:
        return None
    bins = max(len(c) for _, _, c in series)
    shares = [[c / (sum(counts) or 1) for c in counts] for _, _, counts in series]
    top = max((s for row in shares for s in row), default=0.0) or 1.0
    plot_h, bin_w = 140.0, max(24.0, min(60.0, 480 / bins))
    bar_w = (bin_w - 6) / len(series)
    body: list[str] = []
    for k, (label, cls, counts) in enumerate(series):
        body.append(_el("rect", {"x": 40 + k * 100, "y": 4, "width": 10, "height": 10, "class": cls}))
        body.append(_text(54 + k * 100, 13, label, class_="svg-label"))
        for b, count in enumerate(counts):
            h = shares[k][b] / top * plot_h
            tip = f"{label}: {format_number(count)} steps accepted {b} tokens ({shares[k][b]:.1%})"
            x = 30 + b * bin_w + 3 + k * bar_w
            body.append(_el("rect", {"x": f"{x:.1f}", "y": f"{20 + plot_h - h:.1f}",
                                     "width": f"{bar_w:.1f}", "height": f"{h:.1f}", "class": cls}, _title(tip)))
            if count:  # the count itself above its bar
                body.append(_text(x + bar_w / 2, 20 + plot_h - h - 2, format_number(int(count)), text_anchor="middle",
                                  class_="svg-label"))
    # y axis: share of steps, 0 and the tallest bar's share
    body.append(_el("line", {"x1": 28, "y1": 20, "x2": 28, "y2": 20 + plot_h, "stroke": "#57606a"}))
    body.append(_el("line", {"x1": 28, "y1": 20 + plot_h, "x2": 30 + bins * bin_w, "y2": 20 + plot_h,
                             "stroke": "#57606a"}))
    body.append(_text(25, 20 + plot_h, "0%", text_anchor="end", class_="svg-label"))
    body.append(_text(25, 28, f"{top:.0%}", text_anchor="end", class_="svg-label"))
    body.append(_text(25, 20 + plot_h / 2, "steps", text_anchor="end", class_="svg-label"))
    for b in range(bins):
        body.append(_text(30 + b * bin_w + bin_w / 2, 20 + plot_h + 14, str(b), text_anchor="middle",
                          class_="svg-label"))
    body.append(_text(30 + bins * bin_w / 2, 20 + plot_h + 28, "accepted tokens per step", text_anchor="middle",
                      class_="svg-label"))
    return _svg(max(30 + bins * bin_w + 10, 260), 20 + plot_h + 34, "acceptance histogram", body)


def _counts(value: Any) -> list[float]:
    if not isinstance(value, list):
        return []
    counts = [number(v) for v in value]
    return [c if c is not None and math.isfinite(c) and c > 0 else 0.0 for c in counts]


_PASS_MARK, _LOW_MARK = "#2da44e", "#cf222e"


def p_value_strip(metrics: dict[str, Any]) -> Markup | None:
    """sampling_distribution's strip: one row per prompt and path, one square per teacher-forced position, green
    at or above the check's threshold, red below it, outlined black where a token was drawn outside the reference's
    support (metrics p_value_strip, outside_strip, threshold); None without them."""
    rows, threshold = metrics.get("p_value_strip"), number(metrics.get("threshold"))
    if not isinstance(rows, dict) or not rows or threshold is None:
        return None
    outside = metrics.get("outside_strip") if isinstance(metrics.get("outside_strip"), dict) else {}
    box, gap, left, top = 10, 2, 96, 4
    width = max(len(v) for v in rows.values() if isinstance(v, list)) if rows else 0
    body: list[str] = []
    for r, (key, values) in enumerate(rows.items()):
        y = top + r * (box + gap)
        body.append(_text(left - 6, y + box - 1, f"prompt {str(key).replace('/', ' ')}", text_anchor="end",
                          class_="svg-label"))
        counts = outside.get(key) if isinstance(outside.get(key), list) else []
        for step, raw in enumerate(values if isinstance(values, list) else []):
            p = number(raw)
            low = p is not None and p < threshold
            out = int(counts[step]) if step < len(counts) and number(counts[step]) else 0
            tip = (f"prompt {key} step {step}: p = {format_number(p)} "
                   f"({'below' if low else 'at or above'} threshold {format_number(threshold)})"
                   + (f", {out} token(s) drawn outside the reference's support" if out else ""))
            attrs = {"x": left + step * (box + gap), "y": y, "width": box, "height": box,
                     "fill": _LOW_MARK if low else _PASS_MARK, "data_step": step, "data_below": int(low),
                     "data_outside": out, "class": "svg-cell-over" if out else "svg-cell"}
            body.append(_el("rect", attrs, _title(tip)))
    height = top + len(rows) * (box + gap) + 4
    return _svg(left + width * (box + gap) + 8, height, "per-position p-values against the threshold", body)
