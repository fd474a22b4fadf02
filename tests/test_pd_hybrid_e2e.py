"""A hybrid model (linear attention with conv and recurrent state, gated full attention, MoE) through
disaggregated prefill/decode over real gloo worlds: tp4 (V heads GCD-duplicated) -> tp2 moves every linear
layer's state by the slice plan and passes every check (negative control); the conv state placed one token
late (pd-state-conv-shift) or read from the prefill rank of the decode rank's number (pd-state-same-rank)
FAILs pd_transfer naming request, linear layer, head slices and ranks, and the logits (positive controls)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.pd_support import cache_fixture, checks_of, pd_suite, run_cells, suite_fixture

suite_file = suite_fixture(pd_suite("pdh", ["tiny-hybrid"], ["tp4>tp2"]), "pdh")
cache_dir = cache_fixture()


def _run(out: Path, suite: Path, cache: Path, *extra: str) -> tuple[int, dict[str, dict]]:
    code, (cell,) = run_cells(out, suite, cache, *extra)
    return code, checks_of(cell)


def test_a_hybrid_model_s_state_moves_to_another_tp_and_passes(tmp_path: Path, suite_file: Path,
                                                                cache_dir: Path) -> None:
    code, checks = _run(tmp_path / "r", suite_file, cache_dir)
    assert code == 0, {n: ch["reason"] for n, ch in checks.items() if ch["verdict"] != "PASS"}
    transfer = checks["pd_transfer"]
    # 3 requests x 2 routes x 2 decode ranks x (3 V + 1 K slices) x 6 linear layers
    assert transfer["metrics"]["state_slices_checked"] == 3 * 2 * 2 * 4 * 6
    assert transfer["metrics"]["mismatches"] == 0 and "linear-attention state slices" in transfer["reason"]
    for name in ("logits_decode", "generation", "pd_load", "pd_consistency"):
        assert checks[name]["verdict"] == "PASS", (name, checks[name]["reason"])


@pytest.mark.parametrize(("fault", "where"), [
    ("pd-state-conv-shift", "request 0 (decode_path) linear layer 0 state of V head 0, V head 1, V head 2, K head 0 "
                            "on decode rank 0: differs from what prefill ranks 0 sent (the state after 3 tokens)"),
    ("pd-state-same-rank", "request 0 (decode_path) linear layer 0 state of V head 3, V head 4, V head 5, K head 1 "
                           "on decode rank 1: differs from what prefill ranks 2 sent (the state after 3 tokens)"),
])
def test_a_misplaced_state_fails_naming_where(tmp_path: Path, suite_file: Path, cache_dir: Path, fault: str,
                                             where: str) -> None:
    code, checks = _run(tmp_path / "r", suite_file, cache_dir, "--fault", fault)
    assert code == 1
    assert checks["logits_decode"]["verdict"] == "FAIL"
    reason = checks["pd_transfer"]["reason"]
    assert checks["pd_transfer"]["verdict"] == "FAIL", reason
    assert where in reason
    assert checks["pd_load"]["verdict"] == "PASS"  # the load itself succeeded: only the placement is wrong
