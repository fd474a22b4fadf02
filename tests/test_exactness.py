"""Exactness where an engine promises it: an engine that declares batch invariance (the embedded engine's
batch-invariant mode, an engine template's `batch_invariant: true`) is held to bitwise equality by batch_invariance
and self_consistency. End to end over real gloo runs (tiny-gqa tp2, embedded:batch-invariant): a clean cell PASSes
bitwise (negative control), and the batch-variant-decode fault, a difference of rounding size that the noise-bounded
comparison passes, FAILs naming the first request and position (positive control)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from harness.backends.embedded.backend import EmbeddedBackend
from harness.cli import main
from harness.compare.exact import first_difference
from harness.compare.parity.schedule import GEN, TWIN, Steps, check_schedule
from harness.compare.settings import ScheduleSettings
from harness.core.errors import ConfigError
from harness.records.artifacts import read_run
from harness.records.contract import tensor_key
from harness.records.results import results_cells
from harness.specs.engine import load_engine

SUITE = """
name: exact
version: 1
models: [tiny-gqa]
topologies: [tp2]
max_new_tokens: 8
decode_prefix_tokens: 2
kv_budget_mib: 8
max_seq_len: 128
prompts: ["The capital of France is"]
checks: {layout: {}, logits: {}}
workloads: [concurrent, self-consistency]
"""


def _steps(lps: list[list[float]], tokens: list[int]) -> Steps:
    return Steps(tokens, torch.tensor([[t, t + 1] for t in tokens]), torch.tensor(lps, dtype=torch.float64))


def test_one_ulp_is_a_difference_and_equal_bits_are_none() -> None:
    base = _steps([[-0.5, -1.0], [-0.25, -2.0]], [3, 4])
    assert first_difference(base, _steps([[-0.5, -1.0], [-0.25, -2.0]], [3, 4])) is None
    ulp = math.nextafter(-2.0, 0.0)
    step, what = first_difference(base, _steps([[-0.5, -1.0], [-0.25, ulp]], [3, 4])) or (None, "")
    assert step == 1 and what.startswith("top-2 logprob")
    assert first_difference(base, _steps([[-0.5, -1.0]], [3])) == (1, "1 generated tokens vs 2")
    assert first_difference(base, _steps([[math.nan, -1.0], [-0.25, -2.0]], [3, 4]))[0] == 0  # type: ignore[index]


def test_declarations_come_from_the_engine_option_and_the_templates() -> None:
    assert EmbeddedBackend("batch-invariant").capabilities().batch_invariant
    assert EmbeddedBackend("batch-invariant").worker_args() == ["--batch-invariant"]
    assert not EmbeddedBackend().capabilities().batch_invariant
    assert "batch_invariant" not in EmbeddedBackend().capabilities().to_dict()
    with pytest.raises(ConfigError, match="takes no option but 'batch-invariant'.*got 'fast'"):
        EmbeddedBackend("fast")
    vllm, variant = load_engine("vllm"), load_engine("vllm-batch-invariant")
    assert not vllm.batch_invariant and variant.batch_invariant
    assert variant.env == {**vllm.env, "VLLM_BATCH_INVARIANT": "1"} and variant.argv == vllm.argv
    sglang = load_engine("sglang-deterministic")
    assert sglang.batch_invariant and sglang.argv == (*load_engine("sglang").argv, "--enable-deterministic-inference")


def test_a_bad_extends_is_one_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("extends: vlm\nbatch_invariant: true\n")
    with pytest.raises(ConfigError, match="extends='vlm' is not a shipped engine template.*did you mean 'vllm'"):
        load_engine(str(bad))
    bad.write_text("dialect: vllm\nargv: ['{python}', '{tp}', '{dcp}']\nargv_extra: ['--x']\n")
    with pytest.raises(ConfigError, match="argv_extra appends to the argv of the template it extends"):
        load_engine(str(bad))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One clean and one batch-variant-decode run of the suite on embedded:batch-invariant, one cache."""
    root = tmp_path_factory.mktemp("exact")
    (root / "exact.yaml").write_text(SUITE)
    out = {}
    for name, extra in (("clean", []), ("fault", ["--fault", "batch-variant-decode"])):
        main(["run", "--suite", str(root / "exact.yaml"), "--engine", "embedded:batch-invariant",
              "--out", str(root / name), "--cache-dir", str(root / "cache"), *extra])
        out[name] = root / name
    return out


def _checks(out: Path) -> dict[tuple[str, str], dict]:
    return {(cell["workload"], ch["name"]): ch for cell in results_cells(out) for ch in cell["checks"]}


def test_a_clean_declared_cell_is_bitwise_equal(runs: dict[str, Path]) -> None:
    checks = _checks(runs["clean"])
    for key in (("concurrent", "batch_invariance"), ("self-consistency", "self_consistency")):
        assert checks[key]["verdict"] == "PASS" and checks[key]["metrics"]["exact"], checks[key]["reason"]
        assert "bitwise equal" in checks[key]["reason"] and checks[key]["metrics"]["steps_compared"] > 0
    assert checks[("concurrent", "batch_invariance")]["metrics"]["route"]["max_running"] > 1  # batches did form
    # the routes that change a request's own arithmetic keep their noise bound
    assert "exact" not in checks[("concurrent", "decode_consistency")]["metrics"]


def test_batch_variant_decode_fails_naming_request_and_position(runs: dict[str, Path]) -> None:
    checks = _checks(runs["fault"])
    bi = checks[("concurrent", "batch_invariance")]
    assert bi["verdict"] == "FAIL", bi["reason"]
    first = bi["metrics"]["first_difference"]
    assert bi["reason"].startswith(f"request {first['request']} differs from its one-batch twin at generation step "
                                   f"{first['step']} (token position ")
    assert "tolerance zero" in bi["reason"] and "logprob" in first["what"]
    assert checks[("self-consistency", "self_consistency")]["verdict"] == "FAIL"
    # the same differences are within the noise bound: only the exact comparison sees them
    fault, clean = (read_run(next((runs[n] / "runs").rglob("manifest.json")).parent) for n in ("fault", "clean"))
    assert all(tensor_key(k, c.index) in fault.tensors for c in fault.cases for k in (*GEN, *TWIN))
    bounded = check_schedule("batch_invariance", fault, clean, None, ScheduleSettings(), "staggered vs one batch")
    assert bounded.verdict.value == "PASS", bounded.reason
