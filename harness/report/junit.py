"""junit.xml for CI: one testsuite per (suite, model), one testcase per cell x check.

classname is "suite.model.topology[.fault]" (plus ".seedN" where a cell ran with several seeds),
name is the check name. FAIL -> <failure>, ERROR -> <error>, SKIP -> <skipped>, WARN passes with
its reason in <system-out>. A cell without checks yields one skipped testcase named "(no checks)".
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

from harness.core.jsonio import write_bytes_atomic
from harness.core.verdict import CellResult, CheckResult, Verdict
from harness.report.logs import clean_log, xml_safe
from harness.report.matrix import class_label, localization_text, metrics_text
from harness.specs.workload import SUITE_PROMPTS

JUNIT_FILE = "junit.xml"


def _classnames(cells: list[CellResult]) -> list[str]:
    seeds: dict[tuple[str, str, str, str | None], set[int]] = defaultdict(set)
    for c in cells:
        seeds[(c.suite, c.model, c.topology, c.fault)].add(c.seed)
    names = []
    for c in cells:
        parts = [c.suite, c.model, c.topology, *([c.fault] if c.fault else []),
                 *([c.workload] if c.workload != SUITE_PROMPTS else [])]
        if len(seeds[(c.suite, c.model, c.topology, c.fault)]) > 1:
            parts.append(f"seed{c.seed}")
        names.append(".".join(parts))
    return names


def _lists_text(check: CheckResult) -> list[str]:
    """The check's lists of text (e.g. every layout problem), one '- item' line each under 'name:'."""
    out = []
    for name, value in check.metrics.items():
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            out += [f"{name}:", *(f"- {v}" for v in value)]
    return out


def _testcase(parent: ET.Element, classname: str, check: CheckResult, cell: CellResult) -> None:
    case = ET.SubElement(parent, "testcase", classname=xml_safe(classname), name=xml_safe(check.name))
    if cell.command:
        ET.SubElement(case, "properties").append(ET.Element("property", name="command", value=xml_safe(cell.command)))
    body = "\n".join([*_lists_text(check), *metrics_text(check.metrics)])
    reason = xml_safe(check.reason)
    if check.verdict is Verdict.FAIL:
        kind = class_label(cell).replace(" ", "-") or "FAIL"  # silent-corruption, performance-only, ...
        where = f"localization: {localization_text(cell.localization)}\n" if cell.localization else ""
        ET.SubElement(case, "failure", message=reason, type=kind).text = xml_safe(where + body)
    elif check.verdict is Verdict.ERROR:
        text = clean_log(cell.error_log) if cell.error_log else xml_safe(body)
        ET.SubElement(case, "error", message=reason, type="infrastructure").text = text
    elif check.verdict is Verdict.SKIP:  # the reason as message and text: CI pages show one or the other
        ET.SubElement(case, "skipped", message=reason).text = reason
    elif check.verdict is Verdict.WARN:
        ET.SubElement(case, "system-out").text = xml_safe(f"WARN: {check.reason}\n{body}")


def build_junit(cells: list[CellResult]) -> ET.ElementTree:
    root = ET.Element("testsuites", name="harness")
    suites: dict[tuple[str, str], ET.Element] = {}
    for cell, classname in zip(cells, _classnames(cells)):
        key = (cell.suite, cell.model)
        if key not in suites:
            suites[key] = ET.SubElement(root, "testsuite", name=xml_safe(f"{cell.suite}.{cell.model}"))
        checks = cell.checks or (CheckResult("(no checks)", Verdict.SKIP, "no checks ran for this cell"),)
        for check in checks:
            _testcase(suites[key], classname, check, cell)
        suite = suites[key]
        suite.set("time", f"{float(suite.get('time', '0')) + cell.wall_s:.3f}")
    for suite in [root, *suites.values()]:
        _count(suite)
    return ET.ElementTree(root)


def _count(element: ET.Element) -> None:
    cases = list(element.iter("testcase"))
    element.set("tests", str(len(cases)))
    for tag, attr in (("failure", "failures"), ("error", "errors"), ("skipped", "skipped")):
        element.set(attr, str(sum(1 for c in cases if c.find(tag) is not None)))


def write_junit(out_dir: Path, cells: list[CellResult]) -> Path:
    path = out_dir / JUNIT_FILE
    tree = build_junit(cells)
    ET.indent(tree)
    write_bytes_atomic(path, ET.tostring(tree.getroot(), encoding="utf-8", xml_declaration=True))
    return path
