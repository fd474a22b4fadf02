"""self_consistency (harness/compare/parity/self_consistency.py) and its workload: the same prompts sent again
into reused slots and state, in another order and alone, held against their first copy without any
reference. Unit controls on synthetic runs; end to end on tiny-hybrid at tp2 (real gloo ranks): clean
PASS (negative control), and the shared state-slot-stale fault FAILs self_consistency while every
parity check against the tp1 reference, which carries the same bug, passes (positive control)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from harness.cli import main
from harness.compare.parity.self_consistency import check_self_consistency, copies
from harness.compare.settings import SelfConsistencySettings
from harness.core.errors import ConfigError
from harness.core.verdict import Verdict
from harness.engine.faults import FAULTS, fault_flags
from harness.partition.layout import plan_layout
from harness.records.artifacts import RunArtifacts
from harness.records.results import results_cells
from harness.specs.topology import parse_topology_name
from harness.specs.workload import WORKLOADS, Workload
from tests.test_compare_support import GQA, synthetic_runs, with_tensors


def _copied(run: RunArtifacts) -> RunArtifacts:
    """`run` with case 1 a second copy of case 0 (same prompt, same generation) and twins equal to gen."""
    cases = [run.cases[0], replace(run.cases[1], prompt_ids=run.cases[0].prompt_ids)]
    tensors = dict(run.tensors)
    for kind in ("tokens", "topk_ids", "topk_logprobs"):
        tensors[f"gen_{kind}.1"] = tensors[f"gen_{kind}.0"].clone()
        for i in (0, 1):
            tensors[f"twin_{kind}.{i}"] = tensors[f"gen_{kind}.{i}"].clone()
    return replace(run, cases=cases, tensors=tensors)


def test_copies_that_agree_pass_and_a_copy_that_leaks_state_fails() -> None:
    _, _, par = synthetic_runs(plan_layout(GQA, 2), n_cases=2)
    run = _copied(par)
    assert copies(run) == [[0, 1]]
    clean = check_self_consistency(run, None, None, SelfConsistencySettings())
    assert clean.verdict is Verdict.PASS, clean.reason
    assert clean.metrics["prompts"] == 2  # the second copy and the first copy's twin, each against the first
    # the second copy (a reused slot) generates another token at step 2, outside any near tie
    tokens = run.tensors["gen_tokens.1"].clone()
    tokens[2:] = (tokens[2:] + 7) % 32
    leaked = check_self_consistency(with_tensors(run, gen_tokens_1=tokens), None, None, SelfConsistencySettings())
    assert leaked.verdict is Verdict.FAIL
    assert "prompt 1 copies against its first copy diverges at generation step 2" in leaked.reason
    # the same tokens but the logprob moved past the floor also FAILs
    lps = run.tensors["gen_topk_logprobs.1"].clone()
    lps[3, 0] -= 0.01
    drift = check_self_consistency(with_tensors(run, gen_topk_logprobs_1=lps), None, None,
                                   SelfConsistencySettings())
    assert drift.verdict is Verdict.FAIL and "logprob difference" in drift.reason
    # a reference whose noise run differs by as much (rounding of the same engine) excuses that drift
    ref = _copied(par)
    noise_lps = ref.tensors["gen_topk_logprobs.0"].clone()
    noise_lps[3, 0] -= 0.01
    noisy = with_tensors(ref, gen_topk_logprobs_0=noise_lps)
    # ... in bfloat16, where rounding explains 0.01 nats (compare/parity/step_rounding.py) ...
    bf16 = replace(noisy, manifest={**noisy.manifest, "dtype": "bfloat16"})
    ref16 = replace(ref, manifest={**ref.manifest, "dtype": "bfloat16"})
    excused = check_self_consistency(with_tensors(run, gen_topk_logprobs_1=lps), ref16, bf16, SelfConsistencySettings())
    assert excused.verdict is Verdict.PASS, excused.reason
    # ... but a float32 reference whose noise run is 0.01 nats off cannot be rounding: a finding naming the step,
    # never a bound 20x wider
    found = check_self_consistency(with_tensors(run, gen_topk_logprobs_1=lps), ref, noisy, SelfConsistencySettings())
    assert found.verdict is Verdict.FAIL
    assert found.reason.startswith("the reference disagrees with itself beyond rounding (copies against")
    assert "logprob difference 1.0e-02" in found.reason and "at prompt 0 step 3" in found.reason


def test_without_copies_the_check_skips() -> None:
    _, _, par = synthetic_runs(plan_layout(GQA, 2), n_cases=2)
    run = _copied(par)
    single = replace(run, cases=[run.cases[0]])
    assert check_self_consistency(single, None, None, SelfConsistencySettings()).verdict is Verdict.SKIP


def test_the_workload_sends_each_prompt_three_times_into_freed_slots() -> None:
    w = WORKLOADS["self-consistency"]
    assert w.route == "self_consistency" and len(w.sent()) == len(w.arrivals)
    prompts = [i for i in w.sent() if w.sent().count(i) > 1]
    assert sorted(set(prompts)) == [0, 1, 2] and all(w.sent().count(i) == 3 for i in (0, 1, 2))
    # the reverse-order copies arrive after the first batch (6 new tokens: steps 0-5) has freed its slots
    assert min(a for a, i in zip(w.arrivals, w.sent()) if a) > w.new_tokens
    assert Workload.from_dict(w.to_dict()) == w


@pytest.mark.parametrize("fields, said", [({"order": (0, 3)}, "order [0, 3] must index"),
                                          ({"order": (0, 1), "arrivals": (0,)}, "arrivals [0] must give one")])
def test_bad_order_or_arrivals_name_the_value(fields: dict, said: str) -> None:
    with pytest.raises(ConfigError, match=said.replace("[", r"\[").replace("]", r"\]")):
        Workload("w", "d", lengths=(3, 4), **fields)


def test_the_noise_run_of_a_shared_fault_carries_it_under_its_perturbation() -> None:
    tp1 = parse_topology_name("tp1")
    flags = fault_flags("noise-reduction-order+state-slot-stale", tp1)
    assert flags.stale_state_slots and flags.split_reduction == 4
    with pytest.raises(ConfigError, match="joins a perturbation"):
        fault_flags("noise-reduction-order+dcp-lse-merge", tp1)  # not a shared fault


SUITE = """
name: sc
version: 1
models: [tiny-hybrid]
topologies: [tp2]
max_new_tokens: 6
decode_prefix_tokens: 2
prompts: ["The capital of France is", "Once upon a time"]
workloads: [prompts, self-consistency]
checks: {layout: {}, logits: {}, generation: {}}
"""


def _cells(tmp_path: Path, *extra: str) -> tuple[int, dict[str, dict[str, dict]]]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    suite = tmp_path / "sc.yaml"
    suite.write_text(SUITE)
    out = tmp_path / "out"
    code = main(["run", "--suite", str(suite), "--out", str(out), "--cache-dir", str(tmp_path / "cache"), *extra])
    return code, {c["workload"]: {ch["name"]: ch for ch in c["checks"]} for c in results_cells(out)}


def test_clean_hybrid_passes_and_a_stale_state_slot_the_reference_shares_fails_only_self_consistency(
        tmp_path: Path) -> None:
    code, cells = _cells(tmp_path / "clean")
    assert code == 0, {w: [(n, c["reason"]) for n, c in ch.items() if c["verdict"] != "PASS"]
                       for w, ch in cells.items()}
    assert cells["self-consistency"]["self_consistency"]["verdict"] == "PASS"
    assert FAULTS["state-slot-stale"].shared
    code, cells = _cells(tmp_path / "fault", "--fault", "state-slot-stale")
    assert code == 1
    sc = cells["self-consistency"]
    assert sc["self_consistency"]["verdict"] == "FAIL", sc["self_consistency"]["reason"]
    parity = ("logits_prefill", "logits_decode", "generation")
    for workload, checks in cells.items():
        for name in parity:
            if name in checks:
                assert checks[name]["verdict"] == "PASS", (workload, name, checks[name]["reason"])
