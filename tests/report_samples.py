"""Hand-built cells for the report's robustness tests only (tests/test_report.py): hostile text in
every field (HTML, control characters, URLs), malformed details, statuses side by side. They use the
check names and metric keys real runs write (layout with its problems list, logits_prefill/decode,
generation, run, cell, gsm8k_baseline, acceptance); what a reader sees of real runs is tested on
real results.json files in tests/test_report_real.py.
"""

from __future__ import annotations

from typing import Any

from harness.core.verdict import CellResult, CheckResult, Localization, Verdict

EVIL_PROMPT = "<script>alert(1)</script> tokens & more"
URL_PROMPT = "see https://example.invalid/page and http://example.invalid"
LOC_SUMMARY = ("layer 0 attention: heads 4-7 on ranks 1 and 3 (DCP group 0) diverge; "
               "KV head ids differ inside DCP group 0")
PROVENANCE: dict[str, Any] = {"harness_version": "0.1.0", "git_commit": "0123456789abcdef", "torch_version": "2.13.0",
                              "python": "3.11.7", "device": "cpu", "dtypes": ["float32"], "seeds": [0],
                              "command": "harness run --suite dcp --topo tp4dcp4", "hostname": "ci-<7>"}


def _rank(rank: int, kv: list[int], group: int, pool: int = 4096) -> dict[str, Any]:
    return {"rank": rank, "q_heads": [2 * rank, 2 * rank + 1], "kv_heads": kv, "dcp_group": group,
            "dcp_rank": rank % 2, "kv_tp_rank": rank // 2, "q_to_kv": [kv[0], kv[0]], "pool_bytes": pool}


def _layout(broken: bool) -> dict[str, Any]:
    planned = [_rank(r, [r // 2], 0 if r < 2 else 1) for r in range(4)]
    actual = [dict(_rank(r, [r if broken else r // 2], 0 if r < 2 else 1), checksum=f"{r // 2:x}" * 64)
              for r in range(4)]
    return {"planned": {"ranks": planned}, "actual": {"ranks": actual}}


def _prompts(diverge: bool) -> list[dict[str, Any]]:
    gen_same = {"ref_text": " Paris & more", "par_text": " Paris & more", "first_divergence": None, "benign": False}
    gen_diff = {"ref_text": " Paris is <big>", "par_text": " Paris was", "first_divergence": 2, "benign": False,
                "ref_token": " is", "par_token": " was",
                "context_ref": {"before": "capital of France is Paris", "token": " is", "after": " <big>"},
                "context_par": {"before": "capital of France is Paris", "token": " was", "after": ""}}
    return [
        {"index": 0, "prompt": "The capital of France is", "prefill": {"max_kl": 1.2e-7, "top1": 1.0},
         "decode": {"max_kl": 3.2 if diverge else 2e-7, "top1": 0.5 if diverge else 1.0},
         "generation": gen_diff if diverge else gen_same},
        {"index": 1, "prompt": EVIL_PROMPT, "prefill": {"max_kl": 1e-7}, "decode": {"max_kl": 1e-7},
         "generation": gen_same},
        {"index": 2, "prompt": URL_PROMPT, "prefill": {}, "decode": {}, "generation": {}},
    ]


def pass_cell() -> CellResult:
    return CellResult(
        suite="dcp", model="tiny-gqa", topology="tp4dcp4", fault=None, seed=0, clean_exit=True,
        checks=(CheckResult("layout", Verdict.PASS, "layout as planned", {"problems": []}),
                CheckResult("logits_decode", Verdict.PASS, "KL within 10x noise floor",
                            {"max_kl": 1.2e-7, "top1": 1.0}),
                CheckResult("generation", Verdict.PASS, "6/6 prompts identical", {"first_divergence": None})),
        command="harness run --suite dcp --topo tp4dcp4 --seed 0", run_dir="runs/tp4dcp4", wall_s=12.5,
        details={"layout": _layout(False), "prompts": _prompts(False),
                 "layer_errors": {"error": [1e-7, 2e-7, 1.5e-7], "noise": [1e-7, 1e-7, 1e-7],
                                  "threshold": [1e-5, 1e-5, 1e-5]}})


def fail_cell() -> CellResult:
    return CellResult(
        suite="dcp", model="tiny-gqa", topology="tp4dcp4", fault="dcp-tp-kv-layout", seed=0, clean_exit=True,
        checks=(CheckResult("layout", Verdict.FAIL, "KV head ids differ inside DCP group 0",
                            {"problems": ["KV head ids differ inside DCP group 0", "rank 1 holds kv heads 1"]}),
                CheckResult("logits_decode", Verdict.FAIL, "decode max KL 3.2 > 1e-5 (noise floor 1e-7)",
                            {"max_kl": 3.2, "top1": 0.5, "headline": "max_kl"}),
                CheckResult("generation", Verdict.FAIL, "prompt 0 diverges at token 2 (gap 4.1, not a near-tie)",
                            {"first_divergence": 2})),
        localization=Localization(layer=0, heads=(4, 5, 6, 7), ranks=(1, 3), kv_heads=(1,), summary=LOC_SUMMARY),
        command="harness run --suite dcp --topo tp4dcp4 --fault dcp-tp-kv-layout --seed 0", wall_s=13.0,
        details={"layout": _layout(True), "prompts": _prompts(True),
                 "layer_errors": {"error": [0.0, 0.8, 1.1, float("inf")], "noise": [1e-7, 1e-7, 2e-7, 2e-7],
                                  "threshold": 1e-5},
                 "head_errors": {"error": [[1e-8] * 4 + [0.5] * 4, [0.1] * 8], "threshold": 1e-5,
                                 "owner_ranks": [0, 0, 1, 1, 2, 2, 3, 3], "kv_heads": [0, 0, 0, 0, 1, 1, 1, 1]}})


def error_cell() -> CellResult:
    return CellResult(
        suite="dcp", model="tiny-gqa", topology="tp2dcp2", fault=None, seed=0, clean_exit=False,
        checks=(CheckResult("run", Verdict.ERROR, "rank 1 exited with signal 9 (SIGKILL)"),),
        command="harness run --suite dcp --topo tp2dcp2 --seed 0",
        error_log="Traceback (most recent call last):\n  <script>boom()</script>\n\x1b[31mKilled\x1b[0m",
        details={})


def skip_cell() -> CellResult:
    return CellResult(
        suite="tp", model="tiny-mqa", topology="tp8", fault=None, seed=0, clean_exit=True,
        checks=(CheckResult("cell", Verdict.SKIP, "tiny-mqa does not split at tp8: needs 8 ranks, the box has 2"),),
        command="harness run --suite tp --topo tp8 --model tiny-mqa --seed 0")


def warn_cell() -> CellResult:
    return CellResult(
        suite="gsm8k", model="smollm2-135m", topology="tp3dcp3", fault=None, seed=0, clean_exit=True,
        checks=(CheckResult("acceptance", Verdict.PASS, "mean acceptance 2.31 vs 2.35",
                            {"mean_acceptance": 2.31}),
                CheckResult("gsm8k_baseline", Verdict.WARN, "no baseline; run harness baseline update --from RUN_DIR",
                            {"score": 0.42, "n": 50})),
        command="harness run --suite gsm8k --topo tp3dcp3 --seed 0",
        details={"speculator": {"kind": "mtp", "k": 3, "mean_acceptance": 2.31, "reference_mean_acceptance": 2.35,
                                "histogram": [5, 10, 20, 15], "reference_histogram": [4, 11, 19, 16],
                                "layout": _layout(False)},
                 "gsm8k": {"task": "gsm8k", "score": 0.42, "n": 50, "answer_agreement": 0.96, "mcnemar_p": 1.0,
                           "baseline": {"score": 0.44, "n": 50, "threshold": 0.3, "alpha": 0.05},
                           "flips": [{"index": 7, "question": "Tom has 3 <apples> & 2 pears?",
                                      "target": "5", "reference_answer": "5", "parallel_answer": "6"}]}})


def all_cells() -> list[CellResult]:
    return [pass_cell(), fail_cell(), error_cell(), skip_cell(), warn_cell()]


def compare_format_cell() -> CellResult:
    """A FAIL cell whose details have the shapes harness.compare writes (layout.json ranks with
    kv_weight_checksums and kv_pool_bytes, layer errors per hidden index with no noise run,
    generation records with token ids and an end-of-text divergence)."""
    planned = [{"rank": r, "q_heads": [r], "kv_heads": [0], "dcp_group": 0, "dcp_rank": r, "dcp_members": [0, 1],
                "kv_tp_rank": 0, "q_to_kv": [0], "group_q_heads": [0, 1], "ffn_shard": [r, 2]} for r in range(2)]
    actual = [{**p, "kv_heads": [r], "q_to_kv": [r], "group_q_to_kv": [0, 1], "kv_pool_bytes": 65536,
               "kv_pool_blocks": 16, "kv_weight_checksums": {str(r): f"{r}abcdef012345678"}}
              for r, p in enumerate(planned)]
    generation = {"index": 0, "prompt": "Hi", "ref_text": "ab", "par_text": "a", "ref_tokens": 2, "par_tokens": 1,
                  "first_divergence": 1, "benign": False, "near_tie_bound": 1e-3, "ref_gap": 2.0,
                  "par_token_gap": None, "ref_token": "b\x07", "par_token": None, "ref_token_id": 98,
                  "par_token_id": None, "context_ref": {"before": "a", "token": "b\x07", "after": ""},
                  "context_par": {"before": "a", "token": "", "after": ""}}
    logits = {"index": 0, "problem": None, "positions": 4, "offset": 0, "max_kl": 2.5, "mean_kl": 1.0,
              "max_abs": 3.0, "mean_abs": 1.0, "top1_agreement": 0.5, "topk_overlap": 0.6, "top1_flips": 2,
              "benign_flips": 0, "first_diverging_position": 1, "kl": [0.0, 2.5], "max_abs_per_position": [0, 3]}
    return CellResult(
        suite="dcp", model="tiny-gqa", topology="tp2dcp2", fault="dcp-tp-kv-layout", seed=0, clean_exit=True,
        checks=(CheckResult("layout", Verdict.FAIL, "KV head ids differ inside DCP group 0 (+1 more)",
                            {"problems": ["KV head ids differ inside DCP group 0", "rank 1 holds kv heads 1"],
                             "tp": 2, "dcp": 2, "pool_expected": {"pool_bytes": 65536}}),
                CheckResult("logits_decode", Verdict.FAIL, "decode: max KL 2.5e+00 > 1.0e-06",
                            {"path": "decode", "max_kl": 2.5, "kl_bound": {"limit": 1e-6},
                             "first_divergence": {"prompt": 0, "position": 1}}),
                CheckResult("generation", Verdict.FAIL, "prompt 0 diverges at token 1",
                            {"prompts": 1, "first_divergence": {"prompt": 0, "position": 1}})),
        localization=Localization(layer=1, heads=(1,), ranks=(1,), kv_heads=(0,), summary=(
            "layer 1 attention: heads 1 on rank 1 (DCP group 0) diverge; reads KV head 0")),
        command="harness run --suite dcp --topo tp2dcp2 --model tiny-gqa --seed 0 --fault dcp-tp-kv-layout",
        details={"layout": {"planned": {"tp": 2, "dcp": 2, "ranks": planned},
                            "actual": {"ranks": actual, "pool": {"budget_bytes": 1048576, "block_size": 16}}},
                 "prompts": [{"index": 0, "prompt": "Hi", "prefill": logits, "decode": logits,
                              "generation": generation}],
                 "layer_errors": {"error": [1e-8, 1e-8, 0.4], "noise": None, "threshold": [1e-4, 1e-4, 1e-4]},
                 "head_errors": {"error": [[1e-9, 1e-9], [1e-9, 0.3]], "noise": None, "threshold": [1e-4, 1e-4],
                                 "owner_ranks": [0, 1], "kv_heads": [0, 0]}})
