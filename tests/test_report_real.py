"""The report of real runs (committed results.json files written by `harness run`, see
tests/report_fixtures.py): what a reader needs is on the page, in summary.md and in junit.xml; and
each kind of report (clean, silent corruption, error, skip, merged) rendered in headless Chromium."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from harness.cli import main
from harness.core.verdict import CheckResult, Verdict
from harness.report import render_all
from harness.report.html import TEMPLATES_DIR, render_html
from harness.report.junit import build_junit
from harness.report.merge import merge
from harness.report.summary import render_summary
from harness.report.svg import acceptance_bars
from tests.report_fixtures import KINDS, RESULTS_DIR, cell, load


def _page(kind: str) -> str:
    cells, provenance, run_id = load(kind)
    return render_html(cells, provenance, run_id)


# the committed fixtures are what a run writes today


@pytest.fixture(scope="module")
def fresh_clean(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The clean fixture's run, launched now."""
    tmp = tmp_path_factory.mktemp("fresh")
    assert main(["run", "--suite", str(RESULTS_DIR / "small.yaml"), "--topo", "tp2dcp2", "--out", str(tmp / "out"),
                 "--cache-dir", str(tmp / "cache")]) == 0
    return json.loads((tmp / "out" / "results.json").read_text())


def test_fixtures_match_a_fresh_run(fresh_clean: dict) -> None:
    """Same checks, metric keys and details keys (values differ run to run only in timings)."""
    committed = json.loads((RESULTS_DIR / "clean" / "results.json").read_text())
    (new,), (old,) = fresh_clean["cells"], committed["cells"]

    def shape(c: dict) -> tuple:
        return ([(ch["name"], ch["verdict"], sorted(ch["metrics"])) for ch in c["checks"]],
                {k: sorted(v) if isinstance(v, dict) else type(v).__name__ for k, v in c["details"].items()},
                sorted(c))
    assert shape(new) == shape(old), "regenerate the fixtures: tests/data/results/regenerate.sh"
    assert set(committed) == set(fresh_clean) and sorted(committed["summary"]) == sorted(fresh_clean["summary"])


def test_fixture_statuses() -> None:
    assert cell("clean").status is Verdict.PASS
    assert cell("corruption").silent_corruption and cell("gcd").silent_corruption
    assert cell("error", "tp2").status is Verdict.ERROR and cell("error", "tp1").status is Verdict.PASS
    assert cell("skip", "tp3").status is Verdict.SKIP and cell("skip", "tp2").status is Verdict.PASS


# the rough edges of issue 12, on real results


def test_diverging_tokens_show_id_and_escaped_text() -> None:
    """A token that decodes to '' or to U+FFFD is shown escaped with its id, never as a blank."""
    page = _page("corruption")
    gens = [p["generation"] for p in cell("corruption").details["prompts"] if p["generation"].get("ref_token_id")]
    assert gens
    for gen in gens:
        assert f"id {gen['ref_token_id']}\u27e9</code>" in page and f"id {gen['par_token_id']}\u27e9</code>" in page
    assert "\ufffd</code>" not in page and "<code>&#39;&#39;</code>" not in page


def test_pool_blocks_that_differ_from_the_plan_are_flagged() -> None:
    """The corrupted layout holds half the KV heads per rank, so its pool has twice the planned blocks."""
    c = cell("corruption")
    planned_blocks = next(ch for ch in c.checks if ch.name == "layout").metrics["pool_expected"]["blocks"]
    actual_blocks = c.details["layout"]["actual"]["ranks"][0]["kv_pool_blocks"]
    assert actual_blocks != planned_blocks
    page = _page("corruption")
    assert re.search(rf'class="mismatch"[^>]*>{actual_blocks} \(plan {planned_blocks}\)</td>', page)
    n = int(re.search(r"(\d+) value\(s\) differ from the plan", page).group(1))  # type: ignore[union-attr]
    table = page.split('<table class="layout">', 1)[1].split("</table>", 1)[0]
    assert n == table.count('<td class="mismatch"') and n >= 2 + 2  # kv_heads and kv_pool_blocks of both ranks
    clean = _page("clean")
    assert "differ from the plan" not in clean and "(plan " not in clean


def test_q_to_kv_has_one_notation() -> None:
    """A per-head mapping is a comma list on both sides ('0,0,0,0 (plan 1,1,1,1)'), never a range."""
    page = _page("gcd")
    cells = re.findall(r'<td class="mismatch" title="actual [^"]*">([^<]*\(plan [^<]*)</td>', page)
    q_to_kv = [t for t in cells if "," in t]
    assert q_to_kv and all("-" not in t for t in q_to_kv), q_to_kv


def test_localization_names_the_wrong_reads() -> None:
    c = cell("gcd")
    assert c.localization is not None
    summary = c.localization.summary
    assert "reads KV heads 0-5" not in summary  # every KV head of tiny-kv6: narrows nothing
    assert "read the wrong KV heads (e.g. head 2 reads 1, planned 0)" in summary and "wrong reads of" in summary


def test_skip_reasons_are_visible_everywhere() -> None:
    cells, provenance, run_id = load("skip")
    reason = cell("skip", "tp3").checks[0].reason
    assert "does not split at tp3" in reason
    page = render_html(cells, provenance, run_id)
    skipped = page.split("<h3>Skipped</h3>", 1)[1].split("</ul>", 1)[0]
    assert reason in skipped  # in the list under the matrix, not only in a tooltip
    drill = page.split('id="cell-', 1)[1]
    assert re.search(r'<details class="cell" id="cell-\d+">\s*<summary><span class="badge v-SKIP">SKIP</span>'
                     r'[^\n]*\n(?:[^\n]*\n)?\s*<span class="muted">cell: ' + re.escape(reason), page), drill[:600]
    assert reason in render_summary(cells, provenance, run_id).split("### Skipped", 1)[1]
    skipped_xml = [e for e in build_junit(cells).getroot().iter("skipped")]
    # the skipped cell's reason, and every other skip (a check without a recorded reference) with its own
    assert any(e.get("message") == reason for e in skipped_xml)
    assert all(e.get("message") and e.text == e.get("message") for e in skipped_xml)


def test_error_reason_holds_the_error_and_the_tail_ends_at_it() -> None:
    cells, provenance, run_id = load("error")
    err = cell("error", "tp2")
    reason = err.checks[0].reason
    assert reason.endswith("rank1: injected failure: crash on rank 1"), reason
    page = render_html(cells, provenance, run_id)
    assert reason in page.split("<h2>Cells</h2>", 1)[0]  # first screen: the problems list
    assert '<div class="logbox"><pre class="log">' in page


def test_counts_labels_and_legend() -> None:
    page = _page("clean")
    assert "1 cell:</span>" in page and "1 cells" not in page
    assert '<span class="zero">0 FAIL</span>' in page and '<span class="v-FAIL">' not in page.split("</div>", 3)[2]
    corrupt = _page("corruption")
    assert "<dt>problems</dt><dd>number of layout problems" in corrupt and "<dt>div@</dt>" in corrupt
    assert "1 cell:</span>" in corrupt and '<span class="v-FAIL">1 FAIL</span>' in corrupt


def test_junit_layout_failure_lists_the_problems() -> None:
    cells, _, _ = load("corruption")
    layout = next(ch for ch in cells[0].checks if ch.name == "layout")
    failure = next(case.find("failure") for case in build_junit(cells).getroot().iter("testcase")
                   if case.get("name") == "layout")
    assert failure is not None and failure.text is not None
    for problem in layout.metrics["problems"]:
        assert f"- {problem}" in failure.text


# headless Chromium: each kind of report as a browser renders it

CHROMIUM = next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser")) if p), None)
SCREENSHOTS = Path(os.environ.get("HARNESS_SCREENSHOT_DIR", Path(__file__).resolve().parents[1] / "reports"
                                  / "screenshots"))
WINDOW = (1280, 800)
# Added to a copy of the page only (the report itself holds no script): measures what the browser laid out.
PROBE = """<script>
const r = (sel) => { const e = document.querySelector(sel); return e ? e.getBoundingClientRect() : null; };
const head = r('.headline'), banner = r('#silent-corruption');
const box = document.querySelector('.logbox'), pre = box ? box.querySelector('pre') : null;
document.body.setAttribute('data-probe', JSON.stringify({
  height: window.innerHeight, headline: head && head.bottom, banner: banner && banner.top,
  headtext: document.querySelector('.headline .title').textContent,
  logbox: box && {overflows: pre.scrollHeight > box.clientHeight,
                  endShown: Math.abs(pre.getBoundingClientRect().bottom - box.getBoundingClientRect().bottom) < 2}}));
</script>"""


def _chromium(html_path: Path, shot: Path, window: tuple[int, int] = WINDOW, script: str = PROBE) -> dict:
    probe = html_path.with_name("probe.html")
    probe.write_text(html_path.read_text(encoding="utf-8").replace("</body>", script + "</body>"), encoding="utf-8")
    base = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
            f"--window-size={window[0]},{window[1]}", f"--user-data-dir={html_path.parent / 'chromium-profile'}"]
    dom = subprocess.run([*base, "--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=180)
    assert dom.returncode == 0, dom.stderr[-2000:]
    match = re.search(r'data-probe="([^"]*)"', dom.stdout)
    assert match, dom.stdout[-2000:]
    shot.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([*base, f"--screenshot={shot}", html_path.as_uri()], capture_output=True, timeout=180, check=True)
    assert shot.stat().st_size > 0
    import html as html_lib
    return json.loads(html_lib.unescape(match.group(1)))


def _render(kind: str, out: Path) -> Path:
    if kind == "merged":  # a corrupted run and an error run merged by `harness report`
        cells, provenance, run_id = merge([RESULTS_DIR / "corruption", RESULTS_DIR / "error"])
    else:
        cells, provenance, run_id = load(kind)
    return render_all(out, cells, provenance, run_id)["html"]


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install -y chromium)")
@pytest.mark.parametrize(("kind", "title"), [
    # corruption is a --fault run (a positive control); merged, the build cells' verdict (an ERROR) leads
    ("clean", "SHIPPABLE"), ("corruption", "POSITIVE CONTROL: FAULT DETECTED"), ("error", "INCOMPLETE"),
    ("skip", "SHIPPABLE"), ("merged", "INCOMPLETE"),
])
def test_report_in_headless_chromium(tmp_path: Path, kind: str, title: str) -> None:
    assert kind in KINDS or kind == "merged"
    probe = _chromium(_render(kind, tmp_path), SCREENSHOTS / f"{kind}.png")
    assert probe["headtext"] == title
    assert probe["headline"] is not None and probe["headline"] <= probe["height"]  # the verdict on the first screen
    if kind in ("corruption", "merged"):
        assert probe["banner"] is not None and probe["banner"] < probe["height"]  # and the corruption banner
    if kind in ("error", "merged"):
        assert probe["logbox"]["endShown"], probe  # the tail opens at its end, where the error is


# the reports issue (items 2, 3, 5, 8): numbers that fit, readable evidence, size and contrast


def _matrix_html(page: str) -> str:
    start = page.index('<table class="matrix">')
    return page[start:page.index("</table>", start)]


def test_matrix_cells_show_noise_multiples_and_link_to_their_rows() -> None:
    page = _page("corruption")
    matrix = _matrix_html(page)
    assert re.search(r"KL \d(\.\d)?e\d+x<", matrix), matrix  # e.g. 'KL 1.2e12x', not 'KL 1161773916233.8x'
    assert not re.search(r"\d{6,}(\.\d+)?x", page)  # no long multiple anywhere, the reasons included
    for ref in re.findall(r'<a href="#(cell-0-ck-[^"]+)">', matrix):
        assert f'id="{ref}"' in page  # each check cell links to its row in the drill-down


def test_tokens_at_the_first_divergence_are_readable_with_top_k() -> None:
    page = _page("corruption")
    prompts = cell("corruption").details["prompts"]
    divergences = page.split('<div class="divergence">')[1:]
    assert divergences and len(divergences) == sum(p["generation"].get("first_divergence") is not None
                                                   for p in prompts)
    for p, block in zip([p for p in prompts if p["generation"].get("first_divergence") is not None], divergences):
        block = block.split("</div>\n  </div>", 1)[0]
        gen = p["generation"]
        assert "\ufffd" not in block
        for side in ("ref", "par"):
            text = gen[f"{side}_token"]
            if text == "" or not text.isprintable() or "\ufffd" in text:  # an id escape stands in for it
                assert f"\u27e8id {gen[f'{side}_token_id']}\u27e9" in block
            topk = gen[f"{side}_topk"]
            assert topk and all(f"\u27e8id {e['id']}\u27e9" in block for e in topk)
        assert '<table class="topk">' in block and "logprob" in block
        assert "\u2026" in block or "&hellip;" in block  # the prompt tail


def test_pass_cells_carry_no_heat_map() -> None:
    clean = _page("clean")
    assert cell("clean").status is Verdict.PASS and "head_errors" in cell("clean").details
    assert 'aria-label="per-head error heat map"' not in clean and "<svg" not in clean
    assert "drawn only for cells that did not pass" in clean
    assert 'aria-label="per-head error heat map"' in _page("corruption")  # the failing cell keeps its evidence
    assert len(clean.encode()) < 40_000


def test_counts_agree_and_the_collectives_unit_is_explained() -> None:
    page = _page("corruption")
    problems = len(next(ch for ch in cell("corruption").checks if ch.name == "layout").metrics["problems"])
    assert f"problems {problems}<" in _matrix_html(page)
    assert f"the layout check lists {problems} problem(s)" in page
    assert "u: unit roundoff of the model dtype" in page


def test_acceptance_histogram_has_axes_and_counts() -> None:
    svg = str(acceptance_bars([5, 3, 12], [4, 4, 12]))
    assert ">0%<" in svg and ">60%<" in svg and ">12<" in svg and ">accepted tokens per step<" in svg


def _luminance(hex_colour: str) -> float:
    h = hex_colour.lstrip("#")
    rgb = [int(h[i:i + 2], 16) / 255 for i in (0, 2, 4)] if len(h) == 6 else [int(c * 2, 16) / 255 for c in h]
    lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def contrast(a: str, b: str) -> float:
    """WCAG 2 contrast ratio of two #rrggbb colours."""
    la, lb = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


def test_verdict_colours_have_wcag_contrast() -> None:
    """Small text on every verdict colour (matrix cells, badges, headlines) at least 4.5:1."""
    css = (TEMPLATES_DIR / "report.css").read_text()
    variables = dict(re.findall(r"--([a-z-]+):\s*(#[0-9a-fA-F]{3,6})", css))
    rules = re.findall(r"\.(v-[A-Z]+|headline\.h-[A-Z]+|hmark-[a-z]+)\s*\{([^}]*)\}", css)
    seen = set()
    for name, body in rules:
        bg = re.search(r"background:\s*(#[0-9a-fA-F]{3,6}|var\(--([a-z-]+)\))", body)
        assert bg, name
        background = bg.group(1) if bg.group(2) is None else variables[bg.group(2)]
        fg = re.search(r"(?<![-\w])color:\s*(#[0-9a-fA-F]{3,6})", body)
        text = fg.group(1) if fg else "#fff"  # headlines and history marks: white text (.headline, .hmark)
        assert contrast(text, background) >= 4.5, (name, text, background, round(contrast(text, background), 2))
        seen.add(name)
    assert {"v-PASS", "v-WARN", "v-FAIL", "v-ERROR", "v-SKIP", "headline.h-PASS", "headline.h-WARN"} <= seen


def _wide() -> list:
    """The corruption cell next to the clean one, each with the many columns of a speculative suite."""
    cells = [cell("corruption"), cell("clean")]
    extra = [CheckResult(f"speculative_acceptance_{kind}", Verdict.FAIL, "acceptance dropped",
                         {"mean_acceptance": 1.234}) for kind in ("draft", "mtp", "draft_baseline", "mtp_baseline",
                                                                 "eagle", "eagle_baseline")]
    import dataclasses
    return [dataclasses.replace(c, checks=(*c.checks, *extra)) for c in cells]


MEASURE = """<script>
const wrap = document.querySelector('.matrix-wrap'), doc = document.documentElement;
document.body.setAttribute('data-probe', JSON.stringify({
  height: window.innerHeight, headline: 0, banner: null, logbox: null, headtext: '',
  page: {scroll: doc.scrollWidth, client: doc.clientWidth},
  wrap: {scroll: wrap.scrollWidth, client: wrap.clientWidth, overflow: getComputedStyle(wrap).overflowX},
  sticky: getComputedStyle(document.querySelector('table.matrix td.keys')).position}));
</script>"""


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install -y chromium)")
@pytest.mark.parametrize("width", [1400, 800])
@pytest.mark.parametrize("kind", ["corruption", "gcd", "wide"])
def test_matrix_fits_in_headless_chromium(tmp_path: Path, kind: str, width: int) -> None:
    """At 1400 px no matrix overflows its container; at 800 px the page itself never scrolls sideways
    (a wide matrix scrolls inside its container, its cell column sticky)."""
    if kind == "wide":
        cells, provenance, run_id = _wide(), {}, "wide"
        html_path = tmp_path / "index.html"
        html_path.write_text(render_html(cells, provenance, run_id), encoding="utf-8")
    else:
        html_path = _render(kind, tmp_path)
    probe = _chromium(html_path, SCREENSHOTS / f"matrix-{kind}-{width}.png", window=(width, 900), script=MEASURE)
    assert probe["page"]["scroll"] <= probe["page"]["client"], probe  # the page: no sideways scrolling
    assert probe["wrap"]["overflow"] == "auto" and probe["sticky"] == "sticky", probe
    if width == 1400:
        assert probe["wrap"]["scroll"] <= probe["wrap"]["client"], probe  # the matrix fits, nothing cut
