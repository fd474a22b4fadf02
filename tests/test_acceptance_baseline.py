"""Speculative acceptance baselines: the file, the gate against it (PASS / FAIL either way / WARN /
SKIP naming the command), `harness baseline update` recording the reference's acceptance, and the
accept-trace localization of the acceptance check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from harness.baselines.acceptance_baseline import (
    BASELINE_CHECK,
    AcceptanceBaseline,
    AcceptanceBaselines,
    AcceptanceKey,
    acceptance_path,
    gate_acceptance,
    load_acceptance,
    read_acceptance,
    write_acceptance,
)
from harness.cli import main
from harness.compare.settings import AcceptanceSettings
from harness.compare.speculative import check_acceptance, trace_step_detail
from harness.core.details import divergence_text
from harness.core.errors import ConfigError
from harness.core.verdict import CellResult, CheckResult, Verdict
from harness.records.results import write_results

KEY = AcceptanceKey(model="tiny-gqa", engine="embedded", speculator="mtp", k=3,
                    settings=(("draft_noise", 0.1), ("mtp_hidden_mix", 0.1)), dtype="float32",
                    weights_hash="11a8a1a7" * 8, prompts_hash="930ec89c" * 8, max_new_tokens=24)
STORED = AcceptanceBaselines((AcceptanceBaseline(KEY, 1.9, (42, 12, 9, 13), {"git_commit": "abc"}),))
SETTINGS = AcceptanceSettings()
COMMAND = "harness baseline update --from RUN --suite spec"


def _gate(mean: float, hist: list[int] | None = None, key: AcceptanceKey = KEY) -> CheckResult:
    return gate_acceptance(STORED, key, mean, hist, SETTINGS, COMMAND)


def test_gate_passes_within_tolerance_and_fails_either_way() -> None:
    assert _gate(1.92, [42, 12, 9, 13]).verdict is Verdict.PASS
    low = _gate(1.7)  # spec-verify-last-draft on tiny-gqa: 1.91 -> ~1.74
    assert low.verdict is Verdict.FAIL and "below" in low.reason and low.name == BASELINE_CHECK
    high = _gate(2.9)  # e.g. the bonus token counted as accepted
    assert high.verdict is Verdict.FAIL and "above" in high.reason
    assert low.metrics["tolerance"] == pytest.approx(max(SETTINGS.baseline_abs_tol, SETTINGS.baseline_rel_tol * 1.9))


def test_gate_warns_on_a_histogram_shift_with_the_same_mean() -> None:
    # same mean (1.9), mass moved from 1 and 2 accepted to 0 and 3: TV 0.2 > tv_warn 0.1
    shifted = _gate(1.9, [50, 4, 1, 21])
    assert shifted.verdict is Verdict.WARN and "total-variation" in shifted.reason


def test_missing_baseline_is_a_skip_naming_the_command() -> None:
    other = AcceptanceKey(**{**KEY.__dict__, "k": 4})
    result = _gate(1.9, key=other)
    assert result.verdict is Verdict.SKIP and COMMAND in result.reason and "k=4" in result.reason
    # another run seed reseeds synthetic weights: another model, whose acceptance has no baseline yet
    reseeded = AcceptanceKey(**{**KEY.__dict__, "weights_hash": "faa9520f" * 8})
    result = _gate(1.9, key=reseeded)
    assert result.verdict is Verdict.SKIP and "weights faa9520ffaa9" in result.reason


def test_file_round_trip_and_bad_files(tmp_path: Path) -> None:
    write_acceptance(STORED, acceptance_path(tmp_path))
    assert load_acceptance(tmp_path) == STORED
    assert load_acceptance(tmp_path / "none").entries == ()
    bad = tmp_path / "bad.yaml"
    bad.write_text("schema_version: 1\nbaselines:\n- {model: m, engine: e, speculator: mtp, k: 3, dtype: float32,"
                   " weights_hash: w, prompts_hash: h, max_new_tokens: 8, mean_accepted_length: 7.5}\n")
    with pytest.raises(ConfigError, match="mean_accepted_length=7.5 must be a number in 1..4"):
        read_acceptance(bad)
    bad.write_text("schema_version: 1\nbaselines:\n- {model: m, engine: e, speculator: mtp, k: 3, dtype: float32,"
                   " weights_hash: w, prompts_hash: h, max_new_tokens: 8, mean_acceptance: 1.5}\n")
    with pytest.raises(ConfigError, match="mean_acceptance"):
        read_acceptance(bad)


def _cell(topology: str, ref_mean: float, fault: str | None = None,
          acceptance: Verdict = Verdict.PASS) -> CellResult:
    spec: dict[str, Any] = {"kind": "mtp", "k": 3, "mean_acceptance": ref_mean, "reference_mean_acceptance": ref_mean,
                            "reference_histogram": [42, 12, 9, 13], "baseline_key": KEY.to_dict()}
    return CellResult(suite="spec", model="tiny-gqa", topology=topology, fault=fault, seed=0,
                      checks=(CheckResult("acceptance", acceptance, "r"),), clean_exit=True,
                      command=f"harness run --suite spec --topo {topology}", details={"speculator": spec})


def test_update_records_the_reference_acceptance_once_per_key(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    cells = [_cell("tp1-mtp", 1.9), _cell("tp4-mtp", 1.9), _cell("tp4-mtp", 1.5, fault="draft-stale-kv"),
             _cell("tp4dcp4-mtp", 1.9, acceptance=Verdict.FAIL)]
    write_results(run, cells, {"git_commit": "abc", "reference": "tp1"}, run_id="run")
    folder = tmp_path / "baselines"
    assert main(["baseline", "update", "--from", str(run), "--dir", str(folder), "--yes"]) == 0
    out = capsys.readouterr().out
    assert "[new]" in out and "fault 'draft-stale-kv' injected" in out and "acceptance check did not pass" in out
    (entry,) = load_acceptance(folder).entries
    assert entry.key == KEY and entry.mean_accepted_length == 1.9 and entry.histogram == (42, 12, 9, 13)
    assert entry.provenance["command"] == "harness run --suite spec --topo tp1-mtp"
    assert main(["baseline", "update", "--from", str(run), "--dir", str(folder)]) == 0  # nothing changes
    assert "up to date" in capsys.readouterr().out
    write_results(run, [_cell("tp1-mtp", 1.9), _cell("tp4-mtp", 2.0)], {}, run_id="run")
    assert main(["baseline", "update", "--from", str(run), "--dir", str(folder), "--yes"]) == 2  # disagree


def test_a_provenance_change_is_reported_and_written_as_for_gsm8k(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The store's one provenance rule: the same acceptance measured by another commit is no new key and
    leaves the gate alone, but `harness baseline update` shows the provenance fields that change, as it
    does for a GSM8K score, and writes them."""
    folder = tmp_path / "baselines"
    run = tmp_path / "run"
    write_results(run, [_cell("tp1-mtp", 1.9)], {"git_commit": "abc", "reference": "tp1"}, run_id="run")
    assert main(["baseline", "update", "--from", str(run), "--dir", str(folder), "--yes"]) == 0
    capsys.readouterr()
    write_results(run, [_cell("tp1-mtp", 1.9)], {"git_commit": "def", "reference": "tp1"}, run_id="run-2")
    assert main(["baseline", "update", "--from", str(run), "--dir", str(folder)]) == 1  # a change: asks first
    out = capsys.readouterr().out
    assert f"~ {KEY.label}:" in out and "provenance.git_commit: 'abc' -> 'def'" in out
    assert "provenance.run_id: 'run' -> 'run-2'" in out and "mean_accepted_length" not in out
    assert main(["baseline", "update", "--from", str(run), "--dir", str(folder), "--yes"]) == 0
    (entry,) = load_acceptance(folder).entries
    assert entry.provenance["git_commit"] == "def" and entry.mean_accepted_length == 1.9
    gate = gate_acceptance(load_acceptance(folder), KEY, 1.9, [42, 12, 9, 13], SETTINGS, COMMAND)
    assert gate.verdict is Verdict.PASS and gate.metrics["baseline_provenance"]["git_commit"] == "def"


def test_trace_localization_names_step_position_and_what_each_accepted() -> None:
    # prompt 0: identical; prompt 1: step 2 differs (reference accepted 3, parallel 0)
    ref = [[1, 0, 2], [2, 1, 3, 0]]
    par = [[1, 0, 2], [2, 1, 0, 0]]
    ref_tokens = [[10, 11, 12, 13, 14, 15, 16], [19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29]]  # [0]: the prefill's
    drafts = torch.tensor([[21, 22, 9], [24, 5, 5], [25, 26, 27], [7, 7, 7]])  # [S, k]

    def describe(j: int, step: int) -> dict[str, Any]:
        r = trace_step_detail(ref[j], ref_tokens[j], drafts, step)
        return {"position": r.pop("start"), "reference": r, "parallel": {"accepted": par[j][step]}}

    result = check_acceptance(ref, par, 3, SETTINGS, [0, 1], describe)
    first = result.metrics["first_trace_divergence"]
    # after the prefill's token and 2+1 + 1+1 committed by steps 0 and 1
    assert (first["prompt"], first["step"], first["position"]) == (1, 2, 6)
    assert first["reference"] == {"accepted": 3, "proposed": [25, 26, 27], "committed": [25, 26, 27, 28]}
    text = divergence_text(first)
    assert text in result.reason and "verify step 2 (new token 6)" in text
    assert "reference accepted 3 of [25, 26, 27]" in text
    same = check_acceptance(ref, ref, 3, SETTINGS, [0, 1], describe)
    assert same.verdict is Verdict.PASS and same.metrics["first_trace_divergence"] is None


def test_vllm_spec_decode_counters_parse_summed_over_label_sets() -> None:
    from harness.backends.http.dialects import parse_spec_counters

    text = ("# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.\n"
            "# TYPE vllm:spec_decode_num_drafts_total counter\n"
            'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0\n'
            'vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 6.0\n'
            'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 48.0\n'
            'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 20.0\n'
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 9.0\n'
            "vllm:prompt_tokens_total 100.0\n")
    assert parse_spec_counters(text) == {"drafts": 16.0, "draft_tokens": 48.0, "accepted_tokens": 20.0}
    assert parse_spec_counters("vllm:prompt_tokens_total 100.0\n") is None


def test_show_lists_the_shipped_acceptance_baselines(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["baseline", "show", "--acceptance"]) == 0
    out = capsys.readouterr().out
    assert "tiny-gqa" in out and "harness-serve" in out and "embedded" in out and "mean accepted length" in out


def test_per_position_counts_and_histogram_are_inverse() -> None:
    from harness.core.acceptance import accepted_per_position, histogram_from_positions
    from harness.core.errors import RunError

    hist = [42, 12, 9, 13]  # 76 verify steps: 34 accepted position 1, 22 position 2, 13 position 3
    assert accepted_per_position(hist) == [34, 22, 13]
    assert histogram_from_positions(76, [34, 22, 13]) == hist
    with pytest.raises(RunError, match="not a prefix acceptance"):
        histogram_from_positions(76, [10, 22, 13])  # position 2 accepted more often than position 1


def test_vllm_per_position_counters_parse_and_give_a_histogram() -> None:
    from harness.backends.http.backend import POSITION_KEY, counters_delta
    from harness.backends.http.dialects import parse_position_counters

    text = ('vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 9.0\n'
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="0"} 1.0\n'
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 4.0\n'
            'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 16.0\n')
    assert parse_position_counters(text) == {0: 10.0, 1: 4.0}
    assert parse_position_counters("vllm:prompt_tokens_total 100.0\n") == {}
    before = {"drafts": 4.0, "accepted_tokens": 2.0, f"{POSITION_KEY}0": 2.0, f"{POSITION_KEY}1": 0.0}
    after = {"drafts": 16.0, "accepted_tokens": 14.0, f"{POSITION_KEY}0": 10.0, f"{POSITION_KEY}1": 4.0}
    delta = counters_delta(before, after)
    assert delta is not None and delta["accepted_per_position"] == [8, 4] and delta["histogram"] == [4, 4, 4]
    assert not any(k.startswith(POSITION_KEY) for k in delta)


def test_position_gate_fails_naming_the_collapsed_position_and_passes_noise() -> None:
    from harness.checks.acceptance_position import gate_positions, rates

    expected = rates([42, 12, 9, 13])  # positions 1..3: 0.447, 0.289, 0.171
    same = gate_positions([42, 12, 9, 13], expected, "the stored baseline", SETTINGS)
    assert same.verdict is Verdict.PASS, same.reason
    noisy = gate_positions([44, 12, 10, 11], expected, "the stored baseline", SETTINGS)  # one step's worth off
    assert noisy.verdict is Verdict.PASS, noisy.reason
    # the last position collapses (TensorRT-LLM #16617's class), positions 1 and 2 hold
    late = gate_positions([42, 12, 21, 1], expected, "the stored baseline", SETTINGS)
    assert late.verdict is Verdict.FAIL and late.reason.startswith("draft position 3: acceptance 0.013"), late.reason
    assert [r["verdict"] for r in late.metrics["positions"]] == ["PASS", "PASS", "FAIL"]
    few = gate_positions([1, 0, 0, 0], [0.05, 0.02, 0.01], "the stored baseline", SETTINGS)  # no power
    assert few.verdict is Verdict.SKIP and "no power at any position" in few.reason
