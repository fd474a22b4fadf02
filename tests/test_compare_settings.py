"""Check settings from a suite: defaults, flat and per-dtype keys, unknown keys rejected."""

from __future__ import annotations

import pytest

from harness.checks.settings import CheckSettings
from harness.compare.settings import (
    DTYPE_DEFAULTS,
    GenerationSettings,
    LocalizationSettings,
    LogitsSettings,
    parse_section,
)
from harness.core.errors import ConfigError
from harness.specs.suite import Suite


def suite(**checks: object) -> Suite:
    return Suite(name="s", version=1, models=("tiny-gqa",), topologies=("tp2",), prompts=("hi",),
                 checks=checks)  # type: ignore[arg-type]


def test_empty_checks_give_the_dataclass_defaults() -> None:
    settings = CheckSettings.from_suite(suite(layout={}, logits={}, generation={}), "float32")
    assert settings == CheckSettings(dtype="float32")


def test_flat_keys_apply_to_every_dtype_and_dtype_sections_override() -> None:
    s = suite(logits={"kl_factor": 100, "float32": {"kl_floor": "1e-8"}, "bfloat16": {"kl_floor": 1.0e-3}},
              generation={"near_tie": 0.2})
    f32 = CheckSettings.from_suite(s, "float32")
    bf16 = CheckSettings.from_suite(s, "bfloat16")
    # YAML 1.1 string '1e-8' -> float
    assert (f32.of(LogitsSettings).kl_factor, f32.of(LogitsSettings).kl_floor) == (100.0, 1e-8)
    assert (bf16.of(LogitsSettings).kl_factor, bf16.of(LogitsSettings).kl_floor) == (100.0, 1e-3)
    # without a float16 section, float16 gets its own dtype default floor (DTYPE_DEFAULTS)
    assert (CheckSettings.from_suite(s, "float16").of(LogitsSettings).kl_floor
            == DTYPE_DEFAULTS["LogitsSettings"]["float16"]["kl_floor"])
    assert f32.of(GenerationSettings).near_tie == bf16.of(GenerationSettings).near_tie == 0.2


def test_unknown_keys_and_sections_are_rejected_with_did_you_mean() -> None:
    with pytest.raises(ConfigError, match=r"checks.logits: unknown key 'kl_flor' \(did you mean 'kl_floor'\?\)"):
        CheckSettings.from_suite(suite(logits={"kl_flor": 1.0}), "float32")
    # a typo inside a dtype section that is not the one in use still fails
    with pytest.raises(ConfigError, match=r"checks.logits.bfloat16: unknown key 'topk_wrn'"):
        CheckSettings.from_suite(suite(logits={"bfloat16": {"topk_wrn": 0.5}}), "float32")
    with pytest.raises(ConfigError, match=r"'bfloat61' is not a dtype section \(did you mean 'bfloat16'\?\)"):
        CheckSettings.from_suite(suite(logits={"bfloat61": {}}), "float32")
    with pytest.raises(ConfigError, match="unknown dtype 'float23'"):
        CheckSettings.from_suite(suite(), "float23")


def test_bad_values_are_rejected_naming_the_place() -> None:
    with pytest.raises(ConfigError, match=r"checks.logits: kl_floor must be a number, got 'tiny'"):
        CheckSettings.from_suite(suite(logits={"kl_floor": "tiny"}), "float32")
    with pytest.raises(ConfigError, match=r"checks.generation: near_tie=-1 must be a non-negative number"):
        CheckSettings.from_suite(suite(generation={"near_tie": -1}), "float32")
    with pytest.raises(ConfigError, match="fail_ratio=0.5 must be >= 1"):
        LogitsSettings(fail_ratio=0.5)
    with pytest.raises(ConfigError, match="topk must be a positive integer"):
        LogitsSettings(topk=0)
    with pytest.raises(ConfigError, match="check_pool must be true or false"):
        CheckSettings.from_suite(suite(layout={"check_pool": "yes"}), "float32")


def test_localization_section_parses_like_the_others() -> None:
    got = parse_section(LocalizationSettings, "checks.localization", {"factor": 10, "float32": {"rel_floor": 1e-5}},
                        "float32")
    assert got == LocalizationSettings(rel_floor=1e-5, factor=10.0)


def test_half_precision_floors_are_looser_than_float32_and_suites_override_them() -> None:
    f32, f16, bf16 = (CheckSettings.from_suite(suite(logits={}), d).of(LogitsSettings)
                      for d in ("float32", "float16", "bfloat16"))
    assert f32.abs_floor < f16.abs_floor < bf16.abs_floor
    assert f32.kl_floor < f16.kl_floor < bf16.kl_floor
    assert CheckSettings.from_suite(suite(logits={"abs_floor": 0.5}), "bfloat16").of(LogitsSettings).abs_floor == 0.5
