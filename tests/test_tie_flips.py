"""The near-tie flip test (harness/compare/parity/tie_flips.py): exact binomial tail, limit, prior and floor."""

from __future__ import annotations

import math

import pytest

from harness.compare.parity.tie_flips import binomial_tail, tie_flip_test
from harness.compare.settings import LogitsSettings
from harness.core.errors import ConfigError


@pytest.mark.parametrize("k, n, p", [(0, 5, 0.3), (3, 5, 0.3), (5, 5, 0.5), (6, 5, 0.5), (2, 10, 0.9), (40, 80, 0.5)])
def test_binomial_tail_matches_the_sum_of_terms(k: int, n: int, p: float) -> None:
    direct = sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k, n + 1))
    assert binomial_tail(k, n, p) == pytest.approx(min(1.0, direct), rel=1e-9, abs=1e-300)


def test_the_limit_is_the_largest_count_that_passes() -> None:
    settings = LogitsSettings()
    base = tie_flip_test(settings, 0, 285, 2, 285)
    for flips in range(base.limit + 3):
        test = tie_flip_test(settings, flips, 285, 2, 285)
        assert test.fails == (flips > base.limit), (flips, test.describe())


def test_false_positives_from_the_issue_pass_and_a_systematic_excess_fails() -> None:
    settings = LogitsSettings()
    # tiny-bf16-big tp4dcp4i16 lengths, logits_decode: 8 flips where the noise run had 2 (same positions)
    assert not tie_flip_test(settings, 8, 300, 2, 300).fails
    # a clean MLA model: 4 flips against a noise run with 1; a clean GQA model: 8 against 2
    assert not tie_flip_test(settings, 4, 120, 1, 120).fails
    # a noise run with 0 flips does not make a single flip (or a handful) significant
    assert not tie_flip_test(settings, 1, 300, 0, 300).fails
    assert not tie_flip_test(settings, 6, 300, 0, 300).fails
    # a systematic excess, 10x the noise run's rate over as many positions, FAILs
    assert tie_flip_test(settings, 30, 300, 3, 300).fails
    # fewer compared steps make the same count more significant (an early-diverging walk)
    assert tie_flip_test(settings, 6, 12, 0, 96).fails and not tie_flip_test(settings, 6, 96, 0, 96).fails


def test_without_a_noise_run_the_count_is_tested_against_zero_flips_in_as_many_steps() -> None:
    settings = LogitsSettings()
    assert tie_flip_test(settings, 20, 100, 0, 0).fails
    assert not tie_flip_test(settings, 5, 100, 0, 0).fails
    assert tie_flip_test(settings, 0, 0, 0, 0).p_value() == 1.0


@pytest.mark.parametrize("alpha", [0.0, 1.0, 2.0])
def test_alpha_outside_the_open_unit_interval_is_refused(alpha: float) -> None:
    with pytest.raises(ConfigError, match="tie_flips_alpha"):
        LogitsSettings(tie_flips_alpha=alpha)
