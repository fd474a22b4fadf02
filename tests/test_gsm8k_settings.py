"""A suite's gsm8k settings, and the paired check built from them."""

from __future__ import annotations

from typing import Any

import pytest

from harness.core.errors import ConfigError
from harness.core.verdict import Verdict
from harness.gsm8k.checks import PAIRED_CHECK, paired_check
from harness.gsm8k.records import FLEXIBLE, STRICT
from harness.gsm8k.settings import GSM8KSettings, gsm8k_settings


def test_defaults_and_parse() -> None:
    s = gsm8k_settings({"task": "gsm8k_cot", "limit": 50, "filter": FLEXIBLE, "detect_drop": 0.1})
    assert (s.task, s.limit, s.filter, s.detect_drop, s.alpha, s.beta, s.sigma) == \
        ("gsm8k_cot", 50, FLEXIBLE, 0.1, 0.05, 0.2, None)
    assert gsm8k_settings(None) == GSM8KSettings()
    assert gsm8k_settings(s.to_dict()) == s


@pytest.mark.parametrize(("data", "message"), [
    ({"limt": 5}, "did you mean 'limit'"),
    ({"limit": 0}, "limit=0 must be >= 1"),
    ({"filter": "strict"}, "did you mean 'strict-match'"),
    ({"alpha": 5}, "alpha=5 must be a fraction"),
    ({"detect_drop": 5.0}, "detect_drop=5.0 must be a fraction"),
    ({"sigma": 50}, "sigma=50 must be in"),
    ({"batch_size": True}, "batch_size must be an integer"),
])
def test_bad_settings(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        gsm8k_settings(data)


def _comparison(n: int, b: int, c: int, p: float, agree: float) -> dict[str, Any]:
    return {"n": n, "filter": STRICT, "ref_score": 0.5, "par_score": 0.5 - (b - c) / n, "answer_agreement": agree,
            "generation_agreement": agree, "b": b, "c": c, "p_value": p, "flips": []}


def test_paired_check_pass_fail() -> None:
    settings = GSM8KSettings()
    ok = paired_check(_comparison(100, 0, 0, 1.0, 1.0), settings)
    assert ok.name == PAIRED_CHECK and ok.verdict is Verdict.PASS
    noisy = paired_check(_comparison(100, 2, 1, 1.0, 0.97), settings)
    assert noisy.verdict is Verdict.PASS and "within noise" in noisy.reason
    worse = paired_check(_comparison(100, 8, 0, 0.0078125, 0.92), settings)
    assert worse.verdict is Verdict.FAIL and "significantly worse" in worse.reason
    scrambled = paired_check(_comparison(20, 1, 1, 1.0, 0.5), settings)
    assert scrambled.verdict is Verdict.FAIL and "answers disagree" in scrambled.reason
    assert scrambled.metrics["answer_agreement"] == 0.5


def test_paired_check_fails_on_generation_disagreement_with_equal_answers() -> None:
    """A small model whose answers never parse agrees on '[invalid]' everywhere: the generations
    still expose a broken parallel run (the SmolLM2 tp3dcp3 KV-layout bug looks exactly like this)."""
    settings = GSM8KSettings()
    same_answers = {**_comparison(10, 0, 0, 1.0, 1.0), "generation_agreement": 0.0}
    broken = paired_check(same_answers, settings)
    assert broken.verdict is Verdict.FAIL and "generations disagree" in broken.reason
    mostly_same = {**_comparison(10, 0, 0, 1.0, 1.0), "generation_agreement": 0.9}
    assert paired_check(mostly_same, settings).verdict is Verdict.PASS


@pytest.mark.parametrize("profile", ["nightly", "full"])
def test_shipped_gsm8k_profiles_kv_budget_holds_their_batch(profile: str) -> None:
    """Every model of the shipped gsm8k suite gets batch_size sequences of max_seq_len at once at the
    reference topology (its KV pool would otherwise cap the batch the profile asks for)."""
    from harness.checks.settings import load_suite
    from harness.formats.locate import load_model
    from harness.partition.layout import plan_layout, pool_capacity
    from harness.specs.suite import with_profile
    from harness.specs.topology import parse_topology_name

    suite = with_profile(load_suite("gsm8k"), profile)
    batch = gsm8k_settings(suite.gsm8k).batch_size
    ref = parse_topology_name(suite.reference)
    for name in suite.models:
        try:
            model = load_model(name)
        except ConfigError as exc:  # a model whose package is not installed
            pytest.skip(str(exc))
        plan = plan_layout(model.attention_shape, ref.tp, ref.dcp)
        slots = pool_capacity(plan, suite.kv_budget_mib * 1024 ** 2, suite.max_seq_len).slots
        assert slots >= batch, (name, profile, slots, batch)


def test_sampling_settings_parse_round_trip_and_bad_values_are_one_error() -> None:
    parse = gsm8k_settings
    assert parse({}).sampling is None and parse({}).describe_sampling() == "greedy"  # greedy stays the default
    sampled = parse({"sampling": {"temperature": 0.7, "seed": 3, "top_k": 20}})
    assert sampled.sampling is not None and sampled.sampling.temperature == 0.7 and sampled.sampling.top_k == 20
    assert parse(sampled.to_dict()) == sampled  # the job carries the settings as to_dict wrote them
    assert sampled.describe_sampling().startswith("sampled (temperature 0.7, top_k 20, seed 3")
    for bad, says in (({"temperature": 0}, "temperature=0 must be > 0"), ({"temp": 1.0}, "unknown keys \\['temp'\\]"),
                      ({"temperature": "hot"}, "give numbers"), ([0.7], "expected a mapping")):
        with pytest.raises(ConfigError, match=says):
            parse({"sampling": bad})
