"""Workloads and the embedded engine's serving loop at world size 1: workload specs and cases, every route
(staggered admission, prefix cache, chunked prefill, preemption by recompute) giving the plain batch's
greedy tokens (negative controls), the engine stats showing each route was taken, a preemption fault
changing the output (positive control), and the schedule / consistency compare functions."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from harness.cases import build_workload_cases, workload_manifest
from harness.cli import main
from harness.compare.parity.bounds import Bound
from harness.compare.parity.schedule import check_consistency, check_schedule
from harness.compare.settings import ConsistencySettings, ScheduleSettings
from harness.core.errors import ConfigError
from harness.core.verdict import Verdict
from harness.engine.faults import fault_flags
from harness.engine.runtime.engine import Engine
from harness.engine.runtime.parallel import ParallelState
from harness.engine.runtime.scheduler import Lane, ServeSettings, ServingLoop
from harness.formats.locate import load_model
from harness.formats.tokenizer import load_tokenizer
from harness.formats.weights import load_weights
from harness.records.artifacts import Case, RunArtifacts
from harness.records.contract import (
    GEN_TOKENS,
    GEN_TOPK_IDS,
    GEN_TOPK_LOGPROBS,
    REPREFILL_TOPK_IDS,
    REPREFILL_TOPK_LOGPROBS,
    TWIN_TOKENS,
    TWIN_TOPK_IDS,
    TWIN_TOPK_LOGPROBS,
    tensor_key,
)
from harness.specs.pool import PoolSettings
from harness.specs.suite import Suite
from harness.specs.topology import Topology
from harness.specs.workload import LONG, WORKLOADS, Workload, WorkloadPlan

SPEC = load_model("tiny-gqa")


def _engine(fault: str | None = None) -> Engine:
    return Engine(SPEC, load_weights(SPEC), ParallelState.single(), fault_flags(fault, Topology(tp=1)),
                  pool=PoolSettings(max_seq_len=256))


@pytest.fixture(scope="module")
def engine() -> Engine:
    return _engine()


def _prompts(lengths: list[int], prefix: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    head = torch.randint(1, SPEC.vocab, (prefix,), generator=gen).tolist()
    return [head + torch.randint(1, SPEC.vocab, (n,), generator=gen).tolist() for n in lengths]


def test_shipped_workloads_and_their_schedules() -> None:
    assert set(WORKLOADS) >= {"lengths", "concurrent", "prefix-cache", "chunked-prefill", "preemption"}
    assert {w.schedule for w in WORKLOADS.values()} <= {"one-at-a-time", "all-at-once", "staggered"}
    assert WORKLOADS["concurrent"].to_dict()["schedule"] == "staggered"  # what an HTTP backend reads
    with pytest.raises(ConfigError, match="schedule 'bursty' is not one of one-at-a-time, all-at-once, staggered"):
        Workload("x", "bad", schedule="bursty")
    with pytest.raises(ConfigError, match="unknown workload 'lenghts'.*did you mean 'lengths'"):
        Suite(name="s", version=1, models=("m",), topologies=("tp1",), prompts=("p",), workloads=("lenghts",))


def test_workload_cases_have_exact_lengths_shared_prefixes_and_token_counts() -> None:
    suite = Suite(name="s", version=1, models=("m",), topologies=("tp1",), prompts=("Hello there", "Hi"),
                  workloads=("prompts", "lengths", "prefix-cache"), long_context=40, max_new_tokens=6)
    plan = WorkloadPlan(suite.resolved_workloads())
    groups = build_workload_cases(plan, list(suite.prompts), load_tokenizer(SPEC), 0, 4)
    indices = [c.index for g in groups for c in g.cases]
    assert indices == list(range(len(indices)))  # consecutive across workloads
    lengths = groups[1]
    expected = [40 if n == LONG else n for n in WORKLOADS["lengths"].lengths]
    assert [len(c.prompt_ids) for c in lengths.cases] == expected
    assert all(len(c.sequence_ids) - len(c.prompt_ids) == 6 for c in lengths.cases)
    prefix = groups[2].cases
    assert all(c.prompt_ids[:72] == prefix[0].prompt_ids[:72] for c in prefix)
    assert prefix[-1].prompt_ids == prefix[0].prompt_ids  # the first prompt again
    entry = workload_manifest(groups)[1]
    assert entry["name"] == "lengths" and entry["cases"][0] == {
        "index": lengths.cases[0].index, "prompt_tokens": 1, "continuation_tokens": 6, "tokens": 7}


@pytest.mark.parametrize(("settings", "lengths", "prefix", "stat"), [
    (ServeSettings(schedule="staggered", join_per_step=1), [5, 17, 40, 9], 0, "max_running"),
    (ServeSettings(schedule="one-at-a-time"), [5, 17, 9], 0, "steps"),
    (ServeSettings(schedule="staggered", prefix_cache=True), [3, 12, 7, 3], 40, "prefix_hits"),
    (ServeSettings(chunk_tokens=16), [70, 6, 20], 0, "chunked_prompts"),
    (ServeSettings(kv_tokens=160), [40, 33, 50, 24], 0, "preemptions"),
])
def test_every_route_gives_the_plain_batch_tokens(engine: Engine, settings: ServeSettings, lengths: list[int],
                                                 prefix: int, stat: str) -> None:
    prompts = _prompts(lengths, prefix)
    if settings.prefix_cache:
        prompts.append(list(prompts[0]))  # the same prompt twice
    new = [10] * len(prompts)
    (plain, _), (routed, stats) = ServingLoop(engine).run([Lane(prompts, new), Lane(prompts, new, settings)])
    assert getattr(stats, stat) > (1 if stat == "max_running" else 0), stats
    assert routed.tokens == plain.tokens
    for a, b in zip(routed.topk_logprobs, plain.topk_logprobs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
    assert not engine.cache.seqs and engine.cache.free_blocks == engine.capacity.blocks  # every block given back


def test_prefix_hits_reuse_whole_virtual_blocks(engine: Engine) -> None:
    prompts = _prompts([3, 12, 7], prefix=40)
    loop = ServingLoop(engine, ServeSettings(schedule="staggered", prefix_cache=True))
    loop.generate(prompts, [4] * 3)
    assert loop.stats.prefix_hits == 2 and loop.stats.prefix_hit_tokens == 2 * 32  # 40 tokens: 2 blocks of 16


def test_a_hybrid_model_takes_no_prefix_hit_and_keeps_its_tokens() -> None:
    """A hit skips the prefix's forward, which a linear layer's recurrent state needs: no hit, same tokens
    (the prefix-cache cells of the hybrid suite diverged at step 1 when the attention blocks were hit)."""
    spec = load_model("tiny-hybrid")
    engine = Engine(spec, load_weights(spec), ParallelState.single(), pool=PoolSettings(max_seq_len=256))
    gen = torch.Generator().manual_seed(1)
    head = torch.randint(1, spec.vocab, (40,), generator=gen).tolist()
    prompts = [head + torch.randint(1, spec.vocab, (n,), generator=gen).tolist() for n in (3, 12, 7)]
    new = [6] * len(prompts)
    settings = ServeSettings(schedule="staggered", prefix_cache=True)
    (plain, _), (routed, stats) = ServingLoop(engine).run([Lane(prompts, new), Lane(prompts, new, settings)])
    assert routed.tokens == plain.tokens
    assert stats.prefix_hits == 0


def test_a_wrong_resume_position_changes_preempted_output() -> None:
    """preempt-resume-position (positive control): only the preempted sequence's output moves."""
    prompts, new = _prompts([40, 33, 50, 24]), [10] * 4
    settings = ServeSettings(kv_tokens=160)
    clean = ServingLoop(_engine(), settings).generate(prompts, new)
    loop = ServingLoop(_engine("preempt-resume-position"), settings)
    broken = loop.generate(prompts, new)
    assert loop.stats.preemptions > 0
    moved = [i for i in range(4) if not torch.allclose(clean.topk_logprobs[i], broken.topk_logprobs[i], atol=1e-3)]
    assert moved and len(moved) < 4, moved


def _run(gen: list[list[float]], other: list[list[float]], kinds: tuple[str, str, str],
         other_kinds: tuple[str, str, str]) -> RunArtifacts:
    """A run of one case whose two generations have these top-2 logprobs per step (ids 1, 2 = its tokens)."""
    tensors = {}
    for lps, (tok, ids, lp) in ((gen, kinds), (other, other_kinds)):
        order = [[1, 2] if a >= b else [2, 1] for a, b in lps]
        if tok:
            tensors[tensor_key(tok, 0)] = torch.tensor([o[0] for o in order])
        tensors[tensor_key(ids, 0)] = torch.tensor(order)
        tensors[tensor_key(lp, 0)] = torch.tensor([sorted(p, reverse=True) for p in lps])
    case = Case(index=0, prompt="p", prompt_ids=(1,), sequence_ids=(1, 2), decode_start=1, probe_positions=(1,))
    return RunArtifacts(path=Path("."), manifest={"status": "ok"}, cases=[case], tensors=tensors)


GEN, TWIN = (GEN_TOKENS, GEN_TOPK_IDS, GEN_TOPK_LOGPROBS), (TWIN_TOKENS, TWIN_TOPK_IDS, TWIN_TOPK_LOGPROBS)
RE = ("", REPREFILL_TOPK_IDS, REPREFILL_TOPK_LOGPROBS)


def test_schedule_check_passes_noise_and_fails_a_clear_divergence_or_nan() -> None:
    steps = [[-0.1, -3.0], [-0.2, -2.5], [-0.3, -2.0]]
    noisy = [[a + 1e-6, b] for a, b in steps]
    clean = _run(noisy, steps, GEN, TWIN)
    ok = check_schedule("prefix_cache", clean, clean, None, ScheduleSettings(), "from cache")
    assert ok.verdict is Verdict.PASS, ok.reason
    flipped = _run([[-3.0, -0.1], *steps[1:]], steps, GEN, TWIN)
    bad = check_schedule("prefix_cache", flipped, clean, None, ScheduleSettings(), "from cache")
    assert bad.verdict is Verdict.FAIL and "diverges at generation step 0" in bad.reason
    nan = _run([[float("nan"), -3.0], *steps[1:]], steps, GEN, TWIN)
    assert check_schedule("prefix_cache", nan, clean, None, ScheduleSettings(), "x").verdict is Verdict.FAIL


def test_decode_consistency_fails_a_decode_path_that_leaves_the_prefill() -> None:
    steps = [[-0.1, -3.0], [-0.2, -2.5]]
    same = _run(steps, [[a + 1e-7, b] for a, b in steps], GEN, RE)
    assert check_consistency(same, same, None, ConsistencySettings()).verdict is Verdict.PASS
    off = _run(steps, [[-0.5, -1.0], [-0.2, -2.5]], GEN, RE)
    result = check_consistency(off, same, None, ConsistencySettings())
    assert result.verdict is Verdict.FAIL and "logprob difference" in result.reason, result.reason
    assert replace(result).metrics["steps_compared"] == 2


def test_decode_consistency_noise_not_finite_at_a_step_is_skipped_not_a_floor_bound() -> None:
    """A noise run whose decode token falls outside its re-prefill's top-k at one step measures an inf
    difference there: that step is skipped, so the bound is 20 x the finite noise (5e-3), not the 1e-4
    floor an inf noise left it at (a clean 2e-2 difference FAILed); a 0.4 difference still FAILs."""
    steps = [[-0.1, -3.0], [-0.2, -2.5]]
    ref = _run(steps, [[a + 5e-3, b] for a, b in steps], GEN, RE)
    noise = _run(steps, [[a + 4e-3, b] for a, b in steps], GEN, RE)
    noise.tensors[tensor_key(REPREFILL_TOPK_IDS, 0)][1] = torch.tensor([3, 4])  # step 1: token 1 outside top-2
    clean = _run(steps, [[a + 2e-2, b] for a, b in steps], GEN, RE)
    ok = check_consistency(clean, ref, noise, ConsistencySettings())
    bound = ok.metrics["logprob_bound"]
    assert ok.verdict is Verdict.PASS, ok.reason
    assert bound["noise"] == pytest.approx(5e-3, rel=1e-4) and bound["limit"] == pytest.approx(0.1, rel=1e-4)
    assert ok.metrics["noise_steps_unmeasured"] == 1 and "noise not finite at 1 step, skipped" in ok.reason
    off = _run(steps, [[a + 0.4, b] for a, b in steps], GEN, RE)
    bad = check_consistency(off, ref, noise, ConsistencySettings())
    assert bad.verdict is Verdict.FAIL and "logprob difference 4.0e-01" in bad.reason, bad.reason
    nan = _run(steps, [[a + 2e-2, b] for a, b in steps], GEN, RE)
    nan.tensors[tensor_key(REPREFILL_TOPK_LOGPROBS, 0)][1, 0] = float("nan")
    assert check_consistency(nan, ref, noise, ConsistencySettings()).verdict is Verdict.FAIL


def test_a_bound_given_a_non_finite_noise_says_it_sits_at_its_floor() -> None:
    bound = Bound(1e-4, 20.0, math.inf)
    assert bound.limit == 1e-4 and bound.describe() == "(floor; noise inf unusable)"
    assert "(noise 1.0e-02 x 20)" in Bound(1e-4, 20.0, 1e-2).compare("x", 0.1)


def test_list_workloads_shows_what_each_sends(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", "workloads"]) == 0
    out = capsys.readouterr().out
    for name in ("lengths", "concurrent", "prefix-cache", "chunked-prefill", "preemption"):
        assert any(line.startswith(name + " ") and " sends " in line for line in out.splitlines()), name
    assert "staggered (1 joining per step)" in out and "a KV pool of 160 tokens (preemption)" in out


def test_an_unknown_workload_is_one_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--suite", "dcp", "--workload", "prefix-cahce"]) == 2
    assert "unknown workload 'prefix-cahce'" in capsys.readouterr().err


def test_a_shared_prefix_is_sized_to_whole_hash_blocks_of_the_run_s_largest_dcp() -> None:
    """At dcp 8 (blocks of 16 x 8 = 128 tokens) the 72-token shared prefix could never hit the prefix cache and
    the feature check called a clean build corrupt: it is lengthened to one whole block; at dcp <= 4 it is
    already one, and a workload without the prefix-cache route keeps its lengths."""
    suite = Suite(name="s", version=1, models=("m",), topologies=("tp1",), prompts=("Hello there",),
                  workloads=("prefix-cache", "lengths"), long_context=40, max_new_tokens=6)
    assert [w.shared_prefix for w in suite.resolved_workloads(hash_block=64)] == [72, 0]
    sized = suite.resolved_workloads(hash_block=128)
    assert [w.shared_prefix for w in sized] == [128, 0]
    cases = build_workload_cases(WorkloadPlan(sized), list(suite.prompts), load_tokenizer(SPEC), 0, 4)[0].cases
    assert all(c.prompt_ids[:128] == cases[0].prompt_ids[:128] for c in cases)
    assert len({c.prompt_ids[128] for c in cases[:3]}) > 1  # the prompts part after the shared 128 tokens
