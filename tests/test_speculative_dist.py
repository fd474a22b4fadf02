"""Speculative decoding in real gloo ranks at tp4dcp4 (the fork launcher): one launch runs every case.

The tp4dcp4 target and its speculators (plain TP layout, dcp = 1) must reproduce the in-process tp1
results: the same plain and speculative tokens, the same per-step acceptance; each speculator fault is
flagged by its own check and by no other."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from typing import Any

import pytest

from harness.compare.layout.attention import check_layout_with_pool
from harness.compare.speculative import check_acceptance, check_lossless
from harness.core.verdict import Verdict
from harness.engine.runtime.engine import Engine
from harness.engine.runtime.parallel import ParallelState
from harness.engine.runtime.scheduler import generate, run_speculative_cases
from harness.engine.speculative.speculator import speculator_for
from harness.formats.locate import load_model
from harness.formats.tokenizer import load_tokenizer
from harness.formats.weights import load_weights
from harness.launcher.launch import thread_env
from harness.partition.layout import plan_layout, plan_speculator, slot_pool
from harness.specs.pool import PoolSettings
from harness.specs.speculative import SpeculativeSettings
from tests.conftest import TEST_LAUNCH_TIMEOUT_S

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a land far away, there lived a",
           "Q: 17 + 25 = ?\nA:", "<script>alert('escape me')</script> tokens & more", "Layout bugs hide in decode"]
CASES = [("mtp", None), ("draft", None), ("mtp", "draft-dcp-kv-heads"), ("draft", "draft-stale-kv"),
         ("mtp", "mtp-wrong-hidden")]
TP, DCP, K, MAX_NEW = 4, 4, 3, 16
POOL = {"budget_bytes": 8 << 20, "max_seq_len": 256}


@pytest.fixture(scope="module")
def spec_and_prompts() -> tuple[Any, list[list[int]]]:
    spec = load_model("tiny-gqa")
    spec = dataclasses.replace(spec, speculator_layers=spec.layers)
    tok = load_tokenizer(spec)
    return spec, [tok.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def tp1(spec_and_prompts) -> dict[str, Any]:
    """The reference: tp1 in this process, clean speculators."""
    spec, prompts = spec_and_prompts
    weights = load_weights(spec)
    target = Engine(spec, weights, ParallelState.single(), pool=PoolSettings(**POOL))
    out: dict[str, Any] = {"plain": generate(target, prompts, MAX_NEW).tokens}
    for kind in ("draft", "mtp"):
        sp = speculator_for(target, kind, weights, SpeculativeSettings(k=K))
        out[kind] = run_speculative_cases(target, sp, prompts, K, MAX_NEW)
    return out


@pytest.fixture(scope="module")
def dist(spec_and_prompts, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    spec, prompts = spec_and_prompts
    folder = tmp_path_factory.mktemp("spec-tp4dcp4")
    config = {"model": spec.to_dict(), "tp": TP, "dcp": DCP, "prompts": prompts, "max_new_tokens": MAX_NEW,
              "speculative": {"k": K}, "cases": [list(c) for c in CASES], "pool": POOL,
              "out": str(folder / "out.json")}
    (folder / "config.json").write_text(json.dumps(config))
    cmd = [sys.executable, "-m", "harness.launcher.forkrun", f"--nproc={TP}",  # torchrun's environment, one import
           "--module=harness.engine.speculative.selftest", "--", str(folder / "config.json")]
    env = {**os.environ, **thread_env(TP, dict(os.environ))}  # as launch() gives its ranks: no oversubscription
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TEST_LAUNCH_TIMEOUT_S, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((folder / "out.json").read_text())
    result["by_case"] = {(c["kind"], c["fault"]): c for c in result["cases"]}
    return result


def _layout(spec: Any, case: dict[str, Any]) -> Any:
    return check_layout_with_pool(plan_speculator(spec.speculator_shape, TP), case["layout"], "speculator_layout")


def test_clean_speculators_match_tp1(dist, tp1, spec_and_prompts) -> None:
    spec, _ = spec_and_prompts
    assert dist["plain"] == tp1["plain"]
    for kind in ("mtp", "draft"):
        case = dist["by_case"][(kind, None)]
        assert case["tokens"] == tp1["plain"]  # lossless on tp4dcp4, and equal to tp1
        assert check_lossless(case["tokens"], dist["plain"]).verdict is Verdict.PASS
        acceptance = check_acceptance(tp1[kind].accepted, case["accepted"], K)
        assert acceptance.verdict is Verdict.PASS and acceptance.metrics["traces_differ"] == 0, acceptance.reason
        assert 1.3 < acceptance.metrics["mean_accepted_length"] < K + 1
        layout = _layout(spec, case)
        assert layout.verdict is Verdict.PASS, layout.reason


def test_speculator_pool_uses_the_dcp1_plan(dist, spec_and_prompts) -> None:
    """The target holds both KV heads on every rank (kv_tp_size 1); the speculator keeps the TP split."""
    spec, _ = spec_and_prompts
    assert all(r["kv_heads"] == [0, 1] for r in dist["target_layout"])
    ranks = dist["by_case"][("mtp", None)]["layout"]["ranks"]
    assert [r["kv_heads"] for r in ranks] == [[0], [0], [1], [1]]
    slots = dist["by_case"][("mtp", None)]["layout"]["slots"]
    want = slot_pool(plan_speculator(spec.speculator_shape, TP), slots, POOL["max_seq_len"], 16)
    dcp_plan = slot_pool(plan_layout(spec.speculator_shape, TP, DCP), slots, POOL["max_seq_len"], 16)
    assert {r["kv_pool_bytes"] for r in ranks} == {want.pool_bytes} != {dcp_plan.pool_bytes}


def test_draft_dcp_kv_heads_flagged_by_layout_only(dist, tp1, spec_and_prompts) -> None:
    spec, _ = spec_and_prompts
    case = dist["by_case"][("mtp", "draft-dcp-kv-heads")]
    layout = _layout(spec, case)
    assert layout.verdict is Verdict.FAIL
    problems = " ".join(layout.metrics["problems"])
    assert "kv heads 0-1, planned 0" in problems and "(2.00x)" in problems, problems
    assert check_lossless(case["tokens"], dist["plain"]).verdict is Verdict.PASS
    assert check_acceptance(tp1["mtp"].accepted, case["accepted"], K).verdict is Verdict.PASS


@pytest.mark.parametrize(("kind", "fault"), [("draft", "draft-stale-kv"), ("mtp", "mtp-wrong-hidden")])
def test_acceptance_faults_flagged_by_acceptance_only(dist, tp1, spec_and_prompts, kind: str, fault: str) -> None:
    spec, _ = spec_and_prompts
    case = dist["by_case"][(kind, fault)]
    acceptance = check_acceptance(tp1[kind].accepted, case["accepted"], K)
    assert acceptance.verdict is Verdict.FAIL, acceptance.reason
    assert check_lossless(case["tokens"], dist["plain"]).verdict is Verdict.PASS
    assert _layout(spec, case).verdict is Verdict.PASS
