"""A cell's GSM8K checks from two run directories: paired with the reference, gated by the baseline."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from harness.baselines.baseline import Measurement, gate_cell, load_baselines
from harness.core.jsonio import read_json
from harness.core.paths import BASELINES_DIR
from harness.core.verdict import CheckResult
from harness.gsm8k.checks import paired_check
from harness.gsm8k.records import GSM8KResult
from harness.gsm8k.settings import GSM8KSettings
from harness.gsm8k.stats import paired_comparison
from harness.records.contract import GSM8K_FILE

RESULT_FILE = GSM8K_FILE  # the run-directory file name (harness.records.contract)


def read_result(run_dir: Path) -> GSM8KResult:
    return GSM8KResult.from_dict(read_json(run_dir / RESULT_FILE))


def gsm8k_checks(ref_dir: Path, par_dir: Path, settings: GSM8KSettings, suite: str, model: str,
                 topology: str, report_dir: str, baselines_dir: Path = BASELINES_DIR
                 ) -> tuple[list[CheckResult], dict[str, Any]]:
    """gsm8k_paired (McNemar, agreement) and gsm8k_baseline (hypothesis test) checks, and details."""
    ref, par = read_result(ref_dir), read_result(par_dir)
    comparison = paired_comparison(ref.records, par.records, settings.filter)
    measured = Measurement(score=par.score(settings.filter), n=par.n,
                           stderr=par.stderrs.get(settings.filter, 0.0), filter=settings.filter)
    gate = gate_cell(load_baselines(suite, baselines_dir), model, settings.task, topology, measured, settings,
                     report_dir)
    details = {**par.summary(settings.filter), "reference_score": ref.score(settings.filter),
               "answer_agreement": comparison["answer_agreement"],
               "generation_agreement": comparison["generation_agreement"], "b": comparison["b"],
               "c": comparison["c"], "p_value": comparison["p_value"], "flips": comparison["flips"],
               "disagreements": comparison["disagreements"],
               "baseline": gate.metrics, "wall_s": par.wall_s, "questions_per_min": questions_per_min(par),
               "reference_questions_per_min": questions_per_min(ref), "batch": par.batch or None,
               "reference_batch": ref.batch or None, "decoding": settings.describe_sampling(),
               "sampling": settings.sampling.to_dict() if settings.sampling is not None else None}
    paired = paired_check(comparison, settings)
    if settings.sampling is not None:  # the report says the cell is sampled, and how
        paired = replace(paired, reason=f"{settings.describe_sampling()}: {paired.reason}")
    return [paired, gate], details


def questions_per_min(result: GSM8KResult) -> float | None:
    """How fast a run answered its questions (its GSM8K wall time), or None when it recorded none."""
    return 60.0 * result.n / result.wall_s if result.wall_s > 0 else None
