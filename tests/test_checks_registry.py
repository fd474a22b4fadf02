"""The check registry on in-memory runs: a check that raises is an ERROR for that check alone,
unmet needs are SKIPs naming the engine, suites switch sections off and never carry unread settings."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.backends.embedded.backend import TOPK_ONLY
from harness.checks.catalog import registered_checks, sections
from harness.checks.context import CellContext, CellInfo
from harness.checks.driver import run_checks
from harness.checks.settings import CheckSettings, load_suite
from harness.core.errors import ConfigError
from harness.core.verdict import Verdict
from harness.partition.layout import plan_layout
from harness.records.contract import FULL_ARTIFACTS as FULL
from harness.records.contract import Capabilities
from tests.test_compare_support import GQA, synthetic_runs, with_tensors

CHECKS = registered_checks()

PLAN = plan_layout(GQA, 4, 4)


def _ctx(ref, par, noise, par_caps: Capabilities = Capabilities(FULL), **kw) -> CellContext:  # type: ignore[no-untyped-def]
    return CellContext(ref=ref, par=par, noise=noise, plan=PLAN, settings=CheckSettings(), par_caps=par_caps,
                       ref_caps=Capabilities(FULL), info=CellInfo(engine="x-engine"), **kw)


def test_a_check_that_raises_is_an_error_with_its_traceback_and_the_others_keep_their_verdicts() -> None:
    ref, noise, par = synthetic_runs(PLAN)
    broken = with_tensors(par, gen_tokens_0=torch.zeros(3, 2, dtype=torch.long))  # [N] expected: int() of a list
    checks = {c.name: c for c in run_checks(_ctx(ref, broken, noise))}
    assert checks["generation"].verdict is Verdict.ERROR
    assert checks["generation"].reason.startswith("check raised TypeError")
    assert "Traceback" in checks["generation"].metrics["traceback"]
    assert all(checks[n].verdict is Verdict.PASS for n in ("inputs", "layout", "logits_prefill", "logits_decode"))


def test_unmet_needs_are_skips_naming_the_engine() -> None:
    ref, noise, par = synthetic_runs(PLAN)
    no_layout = Capabilities(frozenset(TOPK_ONLY - {"layout_report", "kv_pool_size"}), top_k=4)
    # the parallel run keeps its full logits; top-k-only capabilities make the checks use top-k
    checks = {c.name: c for c in run_checks(_ctx(ref, par, noise, par_caps=no_layout))}
    assert checks["layout"].verdict is Verdict.SKIP
    assert checks["layout"].reason == "engine x-engine gives none of layout_report, kv_pool_size: layout unavailable"
    assert checks["localization"].reason == "engine x-engine gives no hidden_states: localization unavailable"
    assert checks["logits_decode"].verdict is Verdict.PASS and checks["logits_decode"].metrics["k"] == 4


def test_enabled_false_switches_a_section_off(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("name: s\nversion: 1\nmodels: [tiny-gqa]\ntopologies: [tp2]\nprompts: [hi]\n"
                    "checks: {generation: {enabled: false, near_tie: 0.01}, logits: {}}\n")
    suite = load_suite(str(path))
    assert suite.check_settings("generation") == {"near_tie": 0.01}  # tolerances parse without the switch
    CheckSettings.from_suite(suite, "float32")
    ref, noise, par = synthetic_runs(PLAN)
    checks = {c.name: c for c in run_checks(_ctx(ref, par, noise, enabled=suite.check_enabled))}
    assert checks["generation"].verdict is Verdict.SKIP and "enabled: false" in checks["generation"].reason
    assert checks["logits_decode"].verdict is Verdict.PASS


@pytest.mark.parametrize("section,body,message", [
    ("gsm8k", "{limit: 3}", "checks.gsm8k takes only 'enabled', got limit"),
    ("speculator_layout", "{check_pool: false}", "checks.speculator_layout takes only 'enabled', got check_pool"),
    ("logits", "{enabled: 1}", "checks.logits.enabled must be true or false"),
])
def test_settings_that_are_never_read_are_rejected(tmp_path: Path, section: str, body: str, message: str) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(f"name: s\nversion: 1\nmodels: [tiny-gqa]\ntopologies: [tp2]\nprompts: [hi]\n"
                    f"checks: {{{section}: {body}}}\n")
    with pytest.raises(ConfigError, match=message):
        load_suite(str(path))


def test_every_section_is_read_by_a_check_and_names_are_unique() -> None:
    assert len({spec.name for spec in CHECKS}) == len(CHECKS)
    assert set(sections()) == {spec.section for spec in CHECKS}


def test_details_are_typed_and_round_trip_through_the_shared_schema() -> None:
    from harness.checks.cell import compare_cell
    from harness.core.details import CellDetails, LayoutDetails

    ref, noise, par = synthetic_runs(PLAN)
    _, _, details = compare_cell(ref, par, noise, PLAN, CheckSettings())
    typed = CellDetails.from_dict(details)
    assert isinstance(typed.layout, LayoutDetails) and typed.layer_errors is not None and typed.prompts
    assert typed.to_dict() == details
    with pytest.raises(ValueError, match="unknown details sections \\['layouts'\\]"):
        CellDetails.from_dict({**details, "layouts": {}})
    with pytest.raises(TypeError):
        CellDetails.from_dict({**details, "layout": {"planned": None, "actual": None, "extra": 1}})


def test_list_engines_and_checks(capsys: pytest.CaptureFixture[str]) -> None:
    from harness.cli import main

    assert main(["list", "engines"]) == 0
    engines = capsys.readouterr().out
    assert "embedded-topk" in engines and "top_k=20" in engines and "replay:DIR" in engines
    assert main(["list", "checks"]) == 0
    lines = capsys.readouterr().out.splitlines()
    localization = next(line for line in lines if line.startswith("localization "))
    assert "hidden_states" in localization
    assert all(any(line.startswith(spec.name + " ") for line in lines) for spec in CHECKS)


def test_the_report_notes_details_that_drift_from_the_schema(tmp_path: Path) -> None:
    from harness.core.verdict import CellResult, CheckResult
    from harness.report import render_all

    cell = CellResult(suite="s", model="m", topology="tp2", fault=None, seed=0, clean_exit=True,
                      checks=(CheckResult("layout", Verdict.FAIL, "x"),), details={"layuot": {}})
    paths = render_all(tmp_path, [cell], {"command": "harness run"}, "run")
    assert "details do not match harness/core/details.py (unknown details sections [&#39;layuot&#39;]" in \
        Path(paths["html"]).read_text()


THIRD_PARTY_CHECK = '''
from dataclasses import dataclass

from harness.records import contract as c
from harness.checks.catalog import CheckSpec
from harness.checks.context import CellContext
from harness.core.verdict import CheckResult, Verdict


@dataclass(frozen=True)
class StepCountSettings:
    slack: int = 0


def step_count(ctx: CellContext) -> list[CheckResult]:
    slack = ctx.settings.of(StepCountSettings).slack
    ref = sum(len(x.generated_ids) for x in ctx.ref.cases)
    par = sum(len(x.generated_ids) for x in ctx.par.cases)
    verdict = Verdict.PASS if par + slack >= ref else Verdict.FAIL
    return [CheckResult("step_count", verdict, f"{par} generated tokens, reference {ref}, slack {slack}")]


SPEC = CheckSpec("step_count", "step_count", "my_checks:step_count", "generates as many tokens",
                 settings=StepCountSettings, requires=(c.GENERATION,))
'''

THIRD_PARTY_DRIVER = '''
import dataclasses
import sys
from pathlib import Path

from harness.checks.catalog import registered_checks
from harness.checks.driver import run_checks
from harness.checks.settings import CheckSettings, load_suite
from harness.core.errors import ConfigError
from tests.test_checks_registry import PLAN, _ctx
from tests.test_compare_support import synthetic_runs

assert [s.name for s in registered_checks()][-1] == "step_count"
suite = load_suite(sys.argv[1])
ref, noise, par = synthetic_runs(PLAN)
ctx = _ctx(ref, par, noise)
ctx = dataclasses.replace(ctx, settings=CheckSettings.from_suite(suite, "float32"))
(result,) = [r for r in run_checks(ctx) if r.name == "step_count"]
print("RESULT", result.verdict.value, result.reason)
try:
    load_suite(sys.argv[2])
except ConfigError as exc:
    print("ERROR", exc)
'''


def test_a_third_party_check_registers_through_its_entry_point(tmp_path: Path) -> None:
    """One module plus one entry point (a real installed distribution on sys.path): the check is listed,
    its suite section is validated against its own settings class, and cells run it."""
    site = tmp_path / "site"
    dist = site / "my_checks-0.1.dist-info"
    dist.mkdir(parents=True)
    (site / "my_checks.py").write_text(THIRD_PARTY_CHECK)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-checks\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[harness.checks]\nstep_count = my_checks:SPEC\n")
    suite = "name: s\nversion: 1\nmodels: [tiny-gqa]\ntopologies: [tp2]\nprompts: [hi]\n"
    (tmp_path / "good.yaml").write_text(suite + "checks: {step_count: {slack: 2}}\n")
    (tmp_path / "bad.yaml").write_text(suite + "checks: {step_count: {slak: 2}}\n")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(root)])}
    listed = subprocess.run([sys.executable, "-m", "harness", "list", "checks"], env=env, capture_output=True,
                            text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert any(line.startswith("step_count ") for line in listed.stdout.splitlines()), listed.stdout
    ran = subprocess.run([sys.executable, "-c", THIRD_PARTY_DRIVER, str(tmp_path / "good.yaml"),
                          str(tmp_path / "bad.yaml")], env=env, capture_output=True, text=True, timeout=120,
                         cwd=root)
    assert ran.returncode == 0, ran.stderr
    assert "RESULT PASS" in ran.stdout and "slack 2" in ran.stdout, ran.stdout
    assert "unknown key 'slak' (did you mean 'slack'?)" in ran.stdout, ran.stdout
    # without the distribution the section is unknown: a suite naming it is refused
    bare = subprocess.run([sys.executable, "-m", "harness", "list", "checks"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(root)})
    assert "step_count" not in bare.stdout
