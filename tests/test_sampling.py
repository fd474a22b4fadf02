"""Sampling under parallelism: the sampling settings, the engine's sampler against the check's own recomputation of
the processed distribution, the goodness-of-fit test's false-positive rate and power, seeded generators, and end to
end over real gloo runs (tiny-gqa tp2): the sampling workload clean (negative control) and each sampler fault a FAIL
of the sampling check it names (positive controls)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from harness.cli import main
from harness.compare.sampling import chi_square_p, distribution, penalized, support
from harness.core.errors import ConfigError
from harness.engine.faults import FAULTS
from harness.engine.runtime.sampler import SLIPS, Sampler
from harness.records.results import results_cells
from harness.specs.sampling import SamplingParams
from harness.specs.workload import WORKLOADS, Workload

PARAMS = SamplingParams(temperature=1.5, top_k=12, top_p=0.95, min_p=0.05, repetition_penalty=1.3,
                        presence_penalty=0.5, frequency_penalty=0.2, seed=3, n=400)


@pytest.mark.parametrize(("key", "value", "says"), [("temperature", 0.0, "temperature=0.0 must be > 0"),
                                                    ("top_p", 1.5, "top_p=1.5 must be in (0, 1]"),
                                                    ("top_k", -1, "top_k=-1 must be >= 0"),
                                                    ("n", 0, "n=0 must be >= 1")])
def test_bad_sampling_settings_are_one_clear_error(key: str, value: float, says: str) -> None:
    with pytest.raises(ConfigError, match=f"sampling: .*{says.replace('(', '.').replace(')', '.')}"):
        SamplingParams(**{key: value})
    with pytest.raises(ConfigError, match="unknown keys \\['topk'\\]"):
        SamplingParams.from_dict({"topk": 3})


def test_a_sampled_workload_round_trips_and_a_greedy_one_serializes_as_before() -> None:
    w = WORKLOADS["sampling"]
    assert Workload.from_dict(w.to_dict()) == w
    assert "sampling" not in WORKLOADS["concurrent"].to_dict()
    seeds = w.request_seeds()
    assert seeds[0] == seeds[3] and len(set(seeds[:3])) == 3  # the first prompt, sent again, keeps its seed


def _case(rng: np.random.Generator, vocab: int = 96) -> tuple[torch.Tensor, list[int], list[int]]:
    logits = torch.from_numpy(rng.normal(0.0, 2.0, vocab)).float()
    return logits, [int(t) for t in rng.integers(0, vocab, 6)], [int(t) for t in rng.integers(0, vocab, 3)]


def test_the_engines_sampler_and_the_checks_recomputation_agree() -> None:
    """Two implementations (the engine's batched torch sampler, the check's float64 numpy recomputation) of the
    processed distribution give the same support and probabilities."""
    rng = np.random.default_rng(0)
    sampler = Sampler.of(PARAMS, 96, 1, 0)
    for _ in range(20):
        logits, prompt, output = _case(rng)
        engine = sampler.probabilities(logits[None], [prompt], [output])[0].numpy()
        x = penalized(logits.double().numpy(), prompt, output, PARAMS)
        keep = support(x, PARAMS)
        assert np.array_equal(engine > 0, keep)
        assert np.allclose(engine, distribution(x, keep, PARAMS), atol=1e-12)


def test_a_seeded_request_draws_the_same_tokens_alone_and_in_a_batch() -> None:
    rng = np.random.default_rng(1)
    sampler = Sampler.of(PARAMS, 96, 1, 0)
    cases = [_case(rng) for _ in range(3)]
    alone = sampler.sample(cases[0][0][None], [cases[0][1]], [cases[0][2]], [sampler.generator(11)], 50)
    batch = sampler.sample(torch.stack([c[0] for c in cases[::-1]]), [c[1] for c in cases[::-1]],
                           [c[2] for c in cases[::-1]], [sampler.generator(s) for s in (13, 12, 11)], 50)
    assert torch.equal(alone[0], batch[2])


def test_the_fit_test_keeps_its_false_positive_rate_and_sees_a_temperature_shift() -> None:
    """Draws from the distribution itself are rejected at about alpha; draws at temperature x 1.5 nearly always
    (400 draws over 12 tokens; docs/checks.md#sampling measures the power per shift)."""
    rng = np.random.default_rng(2)
    x = rng.normal(0.0, 1.5, 12)
    p = np.exp(x) / np.exp(x).sum()
    hot = np.exp(x / 1.5) / np.exp(x / 1.5).sum()
    null = [chi_square_p(np.bincount(rng.choice(12, 400, p=p), minlength=12), p) for _ in range(400)]
    shifted = [chi_square_p(np.bincount(rng.choice(12, 400, p=hot), minlength=12), p) for _ in range(100)]
    assert sum(v < 0.01 for v in null) <= 12  # 1% of 400 = 4 expected
    assert sum(v < 0.01 for v in shifted) >= 90


def test_every_slip_is_a_declared_fault_naming_a_sampling_check() -> None:
    declared = {f.flags.get("sampler_slip"): f for f in FAULTS.values() if "sampler_slip" in f.flags}
    assert set(declared) == set(SLIPS)
    assert all(f.check.startswith("sampling_") for f in declared.values())


SUITE = """
name: samp
version: 1
models: [tiny-gqa]
topologies: [tp2]
max_new_tokens: 8
decode_prefix_tokens: 2
kv_budget_mib: 8
max_seq_len: 256
prompts: ["The capital of France is"]
workloads: [sampling]
checks: {layout: {}, logits: {}}
"""


@pytest.fixture(scope="module")
def suite_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("suite") / "samp.yaml"
    path.write_text(SUITE)
    return path


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


STRIP = re.compile(r'<svg[^>]*aria-label="per-position p-values against the threshold">(.*?)</svg>', re.S)


def _strip_marks(out: Path) -> list[tuple[int, int, int]]:
    """(step, below, outside) of every mark of the report's p-value strip (index.html, as rendered by the run)."""
    (svg,) = STRIP.findall((out / "index.html").read_text())
    return [(int(a), int(b), int(c)) for a, b, c in
            re.findall(r'<rect[^>]*data-step="(\d+)" data-below="(\d)" data-outside="(\d+)"', svg)]


def _below(metrics: dict) -> list[tuple[int, int]]:
    """(row, step) of each position whose p-value is below the check's threshold, from results.json."""
    return [(r, s) for r, values in enumerate(metrics["p_value_strip"].values()) for s, p in enumerate(values)
            if p < metrics["threshold"]]


def _checks(out: Path, suite: Path, cache: Path, *extra: str) -> tuple[int, dict[str, dict]]:
    code = main(["run", "--suite", str(suite), "--out", str(out), "--cache-dir", str(cache), *extra])
    (cell,) = results_cells(out)
    return code, {ch["name"]: ch for ch in cell["checks"]}


def test_the_sampling_workload_is_clean_on_tp2(tmp_path: Path, suite_file: Path, cache_dir: Path) -> None:
    code, checks = _checks(tmp_path / "r", suite_file, cache_dir)
    bad = {n: ch["reason"] for n, ch in checks.items() if ch["verdict"] not in ("PASS", "SKIP")}
    assert code == 0 and not bad, bad
    assert {n: checks[n]["verdict"] for n in ("sampling_distribution", "sampling_ranks", "sampling_seeded")} == \
        dict.fromkeys(("sampling_distribution", "sampling_ranks", "sampling_seeded"), "PASS")
    dist = checks["sampling_distribution"]["metrics"]
    assert dist["tests"] == 4 * 8 * 2 and dist["outside_support"] == 0  # 4 sends x 8 steps x 2 paths
    assert checks["generation"]["verdict"] == "SKIP"  # sampled tokens: not held to the reference's
    marks = _strip_marks(tmp_path / "r")  # the drill-down's strip: one mark per position, none below the threshold
    assert len(marks) == 64 and [m[0] for m in marks] == list(range(8)) * 8
    assert not any(below or outside for _, below, outside in marks)
    assert "<b>0</b> token(s) drawn outside the reference's support" in (tmp_path / "r" / "index.html").read_text()


@pytest.mark.parametrize("fault", sorted(f.name for f in FAULTS.values() if "sampler_slip" in f.flags))
def test_each_sampler_fault_fails_its_sampling_check(tmp_path: Path, suite_file: Path, cache_dir: Path,
                                                     fault: str) -> None:
    code, checks = _checks(tmp_path / "r", suite_file, cache_dir, "--fault", fault)
    assert code != 0
    named = [c.strip() for c in FAULTS[fault].check.split(",")]
    assert all(checks[n]["verdict"] == "FAIL" for n in named), {n: checks[n]["reason"] for n in named}
    assert checks["logits_prefill"]["verdict"] == "PASS"  # the logits agree: the failure is the sampler's
    if "sampling_distribution" in named:
        assert "the sampler is the suspect" in checks["sampling_distribution"]["reason"]
        metrics = checks["sampling_distribution"]["metrics"]
        marks = _strip_marks(tmp_path / "r")  # the strip marks exactly the positions below the threshold
        assert len(marks) == metrics["tests"]
        assert [(i // 8, m[0]) for i, m in enumerate(marks) if m[1]] == _below(metrics)
        assert sum(m[2] for m in marks) == metrics["outside_support"]
        assert any(below or outside for _, below, outside in marks)  # the strip shows where it failed
