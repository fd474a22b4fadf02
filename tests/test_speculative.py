"""Speculative decoding at world size 1, in this process: losslessness, rollback, faults, plan, checks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from harness.compare.layout.attention import check_layout_with_pool
from harness.compare.settings import AcceptanceSettings, LosslessSettings
from harness.compare.speculative import check_acceptance, check_lossless
from harness.core.acceptance import histogram, mean_accepted_length, total_variation
from harness.core.errors import ConfigError, RunError
from harness.core.verdict import Verdict
from harness.engine.fault import FaultFlags
from harness.engine.faults import FAULTS, fault_flags
from harness.engine.runtime.engine import Engine
from harness.engine.runtime.kvcache import PagedKVCache
from harness.engine.runtime.parallel import ParallelState
from harness.engine.runtime.scheduler import generate, run_speculative_cases, speculate
from harness.engine.speculative.decoding import SpecResult, SpeculativeDecoder, spec_manifest, spec_tensors
from harness.engine.speculative.speculator import (
    SpeculativeSettings,
    Speculator,
    speculator_for,
    speculator_plan,
    speculator_weights,
)
from harness.formats.locate import load_model
from harness.formats.tokenizer import load_tokenizer
from harness.formats.weights import load_weights
from harness.partition.layout import plan_layout, plan_speculator, pool_capacity, slot_pool
from harness.specs.model import ModelSpec
from harness.specs.pool import PoolSettings
from harness.specs.topology import Topology, parse_topology_name

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a land far away, there lived a",
           "Q: 17 + 25 = ?\nA:", "<script>alert('escape me')</script> tokens & more", "Layout bugs hide in decode"]
MAX_NEW = 16
POOL = PoolSettings(budget_bytes=8 << 20, max_seq_len=256)


def spec_model(name: str = "tiny-gqa") -> ModelSpec:
    """A tiny model whose speculator is as deep as the target (see speculator.py: agreement)."""
    spec = load_model(name)
    return dataclasses.replace(spec, speculator_layers=spec.layers)


@pytest.fixture(scope="module")
def setup() -> tuple[ModelSpec, dict[str, torch.Tensor], list[list[int]], Engine, list[list[int]]]:
    spec = spec_model()
    weights = load_weights(spec)
    tok = load_tokenizer(spec)
    prompts = [tok.encode(p) for p in PROMPTS]
    target = Engine(spec, weights, ParallelState.single(), pool=POOL)
    plain = generate(target, prompts, MAX_NEW).tokens
    return spec, weights, prompts, target, plain


_RESULTS: dict[tuple[object, ...], SpecResult] = {}


def _speculate(setup, kind: str, flags: FaultFlags = FaultFlags(), k: int = 3, **settings: float) -> SpecResult:
    """Speculative generation of the test prompts, computed once per configuration."""
    key = (kind, flags, k, tuple(sorted(settings.items())))
    if key not in _RESULTS:
        spec, weights, prompts, target, _ = setup
        st = SpeculativeSettings(k=k, **settings)
        sp = Speculator(kind, spec, weights, ParallelState.single(), st, target.capacity.slots, POOL, flags)
        _RESULTS[key] = run_speculative_cases(target, sp, prompts, k, MAX_NEW)
    return _RESULTS[key]


# ---- lossless and acceptance ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["draft", "mtp"])
@pytest.mark.parametrize("k", [1, 3])
def test_speculative_output_equals_plain_greedy(setup, kind: str, k: int) -> None:
    result = _speculate(setup, kind, k=k)
    assert result.tokens == setup[4]
    assert all(0 <= a <= k for steps in result.accepted for a in steps)
    # every verify step commits accepted + 1 tokens; the last step may overshoot max_new_tokens
    for toks, steps in zip(result.tokens, result.accepted):
        assert sum(a + 1 for a in steps) - k <= len(toks) - 1 <= sum(a + 1 for a in steps)


@pytest.mark.parametrize("kind", ["draft", "mtp"])
def test_acceptance_is_neither_zero_nor_one(setup, kind: str) -> None:
    result = _speculate(setup, kind)
    assert 1.3 < result.mean_accepted_length < 3.5, result.histogram
    assert result.histogram[0] > 0 and result.histogram[-1] > 0


def test_draft_noise_tunes_agreement(setup) -> None:
    exact, noisy = _speculate(setup, "draft", draft_noise=0.0), _speculate(setup, "draft", draft_noise=0.3)
    assert exact.mean_accepted_length == 4.0  # an exact copy of the target always agrees
    assert noisy.mean_accepted_length < 1.5


def test_stop_token_and_length_limit(setup) -> None:
    spec, weights, prompts, target, plain = setup
    stop = frozenset({plain[0][5]})
    sp = speculator_for(target, "draft", weights, SpeculativeSettings())
    result = run_speculative_cases(target, sp, prompts[:1], 3, MAX_NEW, stop)
    assert result.tokens[0] == plain[0][:plain[0].index(plain[0][5]) + 1]
    with pytest.raises(ConfigError, match="max_seq_len"):
        run_speculative_cases(target, sp, prompts[:1], 3, POOL.max_seq_len)


def test_abandoned_prompts_stop_at_the_next_step(setup) -> None:
    spec, weights, prompts, target, plain = setup
    decoder = SpeculativeDecoder(target, speculator_for(target, "draft", weights, SpeculativeSettings()), 3)
    asked = []

    def abandoned() -> set[int]:
        asked.append(1)
        return {0} if len(asked) > 2 else set()  # asked before the prefill step and the first verify step

    result = speculate(decoder, prompts[:2], MAX_NEW, abandoned=abandoned)
    assert len(result.tokens[0]) <= 1 + 4 < len(plain[0]) and result.tokens[0] == plain[0][:len(result.tokens[0])]
    assert result.tokens[1] == plain[1] and len(result.accepted[0]) == 1
    assert not target.cache.seqs  # both sequences closed, the abandoned one at once


def test_result_artifacts(setup) -> None:
    result = _speculate(setup, "mtp")
    tensors = spec_tensors(result, [0, 1, 2, 3, 4, 5])
    assert tensors["spec_tokens.2"].tolist() == result.tokens[2]
    assert tensors["spec_accepted.2"].dtype == torch.long
    drafts = tensors["spec_drafts.2"]  # [S, k]: each step's proposals; the accepted ones were committed
    assert drafts.shape == (len(result.accepted[2]), 3)
    start = 1 + result.accepted[2][0] + 1  # the prefill's token, then step 0's accepted + 1
    assert drafts[1, :result.accepted[2][1]].tolist() == result.tokens[2][start:start + result.accepted[2][1]]
    manifest = spec_manifest(result, SpeculativeSettings())
    assert manifest["kind"] == "mtp" and manifest["k"] == 3
    assert sum(manifest["histogram"]) == manifest["steps"] == result.steps
    assert manifest["mean_accepted_length"] == pytest.approx(mean_accepted_length(result.accepted))


# ---- rollback ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["draft", "mtp"])
def test_rollback_keeps_exactly_the_accepted_tokens(setup, kind: str) -> None:
    spec, weights, prompts, target, plain = setup
    sp = speculator_for(target, kind, weights, SpeculativeSettings())
    dec = SpeculativeDecoder(target, sp, k=3)
    seqs = dec.start(prompts)
    rejections = 0
    with torch.no_grad():
        for _ in range(4):
            before = [len(s.tokens) for s in seqs]
            accepted = dec.step(seqs)
            for s, n, a in zip(seqs, before, accepted):
                assert len(s.tokens) == n + a + 1
                # the target holds every committed token but the newest (its bonus token)
                assert target.stored_positions(s.target_id) == list(range(len(s.tokens) - 1))
                # the speculator holds only entries computed from exact inputs
                first = 1 if kind == "mtp" else 0
                assert sp.stored_positions(s.spec_id) == list(range(first, s.spec_valid))
                assert s.spec_valid == (n if kind == "mtp" else n + min(a, 2))
                rejections += a < 3
    dec.close(seqs)
    assert rejections > 0
    assert all(s.generated == p[:len(s.generated)] for s, p in zip(seqs, plain))


def test_stale_kv_fault_keeps_rejected_entries(setup) -> None:
    spec, weights, prompts, target, _ = setup
    sp = Speculator("draft", spec, weights, ParallelState.single(), SpeculativeSettings(), target.capacity.slots,
                    POOL, FaultFlags(speculator_stale_kv=True))
    dec = SpeculativeDecoder(target, sp, k=3)
    seqs = dec.start(prompts)
    with torch.no_grad():
        for _ in range(3):
            dec.step(seqs)
    stale = [s for s in seqs if len(sp.stored_positions(s.spec_id)) > s.spec_valid]
    target_ok = all(target.stored_positions(s.target_id) == list(range(len(s.tokens) - 1)) for s in seqs)
    dec.close(seqs)
    assert stale, "a rejected proposal should have left stale entries"
    assert target_ok  # the target still rolls back


def test_truncate_drops_positions_and_frees_blocks() -> None:
    plan = plan_layout(load_model("tiny-gqa").attention_shape, 1)
    capacity = pool_capacity(plan, 1 << 20, 64, block_size=4)
    cache = PagedKVCache(capacity, 2, 2, 16, torch.float32, torch.device("cpu"))
    cache.add_sequence(0)
    cache.reserve(0, list(range(10)))  # 3 blocks of 4
    assert len(cache.seqs[0].blocks) == 3
    cache.truncate(0, 5)
    assert cache.seqs[0].positions == [0, 1, 2, 3, 4] and len(cache.seqs[0].blocks) == 2
    cache.truncate(0, 4)
    assert len(cache.seqs[0].blocks) == 1
    cache.truncate(0, 9)  # nothing past the end: a no-op
    assert cache.seqs[0].positions == [0, 1, 2, 3]
    slots = cache.reserve(0, [4, 5])
    assert slots == [(cache.seqs[0].blocks[1], 0), (cache.seqs[0].blocks[1], 1)]
    # the freed blocks are reusable: the other tokens of the pool still fit, one more does not
    cache.add_sequence(1)
    cache.reserve(1, list(range(capacity.tokens_per_rank - 2 * capacity.block_size)))
    with pytest.raises(RunError, match="exhausted"):
        cache.reserve(1, [10 ** 6])
    cache.truncate(0, 0)
    cache.reserve(1, [10 ** 6])
    cache.add_sequence(2)
    cache.reserve(2, [0, 1, 2, 1])  # a stale duplicate position: cannot roll back cleanly
    with pytest.raises(RunError, match="increasing"):
        cache.truncate(2, 2)


# ---- faults ------------------------------------------------------------------------------------------------


def test_stale_kv_drops_acceptance_and_stays_lossless(setup) -> None:
    clean, broken = _speculate(setup, "draft"), _speculate(setup, "draft", FaultFlags(speculator_stale_kv=True))
    assert check_lossless(broken.tokens, setup[4]).verdict is Verdict.PASS
    result = check_acceptance(clean.accepted, broken.accepted, 3)
    assert result.verdict is Verdict.FAIL and "drop" in result.reason
    assert check_acceptance(clean.accepted, clean.accepted, 3).verdict is Verdict.PASS


@pytest.mark.parametrize("kind", ["draft", "mtp"])
def test_verify_off_by_one_stays_lossless_and_caps_acceptance(setup, kind: str) -> None:
    """spec-verify-last-draft: a verify bug the reference shares. Output is lossless and the accept
    traces of two runs with the bug agree (the reference check passes); only the level moves."""
    flags = fault_flags("spec-verify-last-draft", parse_topology_name(f"tp1-{kind}"))
    assert FAULTS["spec-verify-last-draft"].shared and flags.verify_skip_last
    clean, broken = _speculate(setup, kind), _speculate(setup, kind, flags)
    assert check_lossless(broken.tokens, setup[4]).verdict is Verdict.PASS
    assert broken.histogram[3] == 0 < clean.histogram[3]  # no step accepts all k drafts any more
    assert broken.mean_accepted_length < clean.mean_accepted_length - 0.05
    assert check_acceptance(broken.accepted, broken.accepted, 3).verdict is Verdict.PASS


def test_mtp_wrong_hidden_is_flagged_by_acceptance(setup) -> None:
    clean, broken = _speculate(setup, "mtp"), _speculate(setup, "mtp", FaultFlags(mtp_hidden_shift=1))
    assert check_lossless(broken.tokens, setup[4]).verdict is Verdict.PASS
    result = check_acceptance(clean.accepted, broken.accepted, 3)
    assert result.verdict is Verdict.FAIL, result.reason
    # a draft model reads no hidden state: the flag is inert there
    assert _speculate(setup, "draft", FaultFlags(mtp_hidden_shift=1)).accepted == _speculate(setup, "draft").accepted


def test_speculator_faults_need_a_speculator() -> None:
    for name in ("draft-stale-kv", "draft-dcp-kv-heads", "mtp-wrong-hidden"):
        assert FAULTS[name].needs_speculator
        with pytest.raises(ConfigError, match="speculative"):
            fault_flags(name, parse_topology_name("tp4dcp4"))
    with pytest.raises(ConfigError, match="-mtp"):
        fault_flags("mtp-wrong-hidden", parse_topology_name("tp4-draft"))
    with pytest.raises(ConfigError, match="DCP"):
        fault_flags("draft-dcp-kv-heads", parse_topology_name("tp4-mtp"))
    assert fault_flags("draft-dcp-kv-heads", parse_topology_name("tp4dcp4-draft")).speculator_kv_dcp
    assert fault_flags("mtp-wrong-hidden", parse_topology_name("tp1-mtp")).mtp_hidden_shift == 1
    assert fault_flags(None, parse_topology_name("tp4dcp4-mtp")) == FaultFlags()


# ---- plan and layout ------------------------------------------------------------------------------------------


def test_speculator_plan_ignores_dcp() -> None:
    spec = spec_model()
    correct = speculator_plan(spec, 4, 4, FaultFlags())
    assert correct == plan_speculator(spec.speculator_shape, 4) == plan_layout(spec.speculator_shape, 4, 1)
    assert [r.kv_heads for r in correct.ranks] == [(0,), (0,), (1,), (1,)]
    pool = slot_pool(correct, 3, 256, 16)
    assert pool.slots == 3 and pool.pool_bytes == pool_capacity(correct, pool.budget_bytes, 256, 16).pool_bytes
    # the fault: KV split by tp // dcp like the target's -> every rank holds both KV heads, 2x the pool
    broken = speculator_plan(spec, 4, 4, FaultFlags(speculator_kv_dcp=True))
    assert [r.kv_heads for r in broken.ranks] == [(0, 1)] * 4
    assert slot_pool(broken, 3, 256, 16).pool_bytes == 2 * pool.pool_bytes


def test_speculator_layout_report_matches_plan(setup) -> None:
    spec, weights, _, target, _ = setup
    sp = speculator_for(target, "mtp", weights, SpeculativeSettings())
    entry = sp.layout_entry([sp.layout_report()])
    assert entry["kind"] == "mtp" and entry["layers"] == spec.speculator_layers
    result = check_layout_with_pool(plan_speculator(spec.speculator_shape, 1), entry, "speculator_layout")
    assert result.verdict is Verdict.PASS, result.reason
    assert entry["ranks"][0]["kv_pool_bytes"] == sp.cache.pool_bytes == slot_pool(
        sp.expected_plan, target.capacity.slots, POOL.max_seq_len, POOL.block_size).pool_bytes


def test_speculator_weights() -> None:
    spec = spec_model()
    target = load_weights(spec)
    draft = speculator_weights("draft", spec, target, SpeculativeSettings(draft_noise=0.1))
    again = speculator_weights("draft", spec, target, SpeculativeSettings(draft_noise=0.1))
    assert all(torch.equal(draft[n], again[n]) for n in draft)  # seeded: identical in every process
    assert draft["embed.weight"] is target["embed.weight"]  # shared vocabulary
    rel = (draft["layers.0.q.weight"] - target["layers.0.q.weight"]).norm() / target["layers.0.q.weight"].norm()
    assert 0.08 < float(rel) < 0.12
    mtp = speculator_weights("mtp", spec, target, SpeculativeSettings())
    assert tuple(mtp["eh_proj.weight"].shape) == (spec.hidden, 2 * spec.hidden)
    assert set(mtp) >= {"hnorm.weight", "enorm.weight", "norm.weight", "embed.weight", "lm_head.weight"}
    with pytest.raises(ConfigError, match="speculator kind"):
        speculator_weights("eagle", spec, target, SpeculativeSettings())
    with pytest.raises(ConfigError, match="speculator_layers"):
        speculator_weights("draft", dataclasses.replace(spec, speculator_layers=3), target, SpeculativeSettings())


def test_settings_parse() -> None:
    assert SpeculativeSettings.from_mapping({"k": 4, "draft_noise": 0.2}) == SpeculativeSettings(k=4, draft_noise=0.2)
    with pytest.raises(ConfigError, match="did you mean 'draft_noise'"):
        SpeculativeSettings.from_mapping({"draft_nosie": 0.2})
    with pytest.raises(ConfigError, match="k must be"):
        SpeculativeSettings(k=0)
    assert AcceptanceSettings(abs_floor="0.1").abs_floor == 0.1  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="within"):
        AcceptanceSettings(trace_fail_fraction=1.5)
    with pytest.raises(ConfigError, match="non-negative"):
        LosslessSettings(near_tie=-1.0)
    assert Topology(tp=4, dcp=4, speculator="mtp").name == "tp4dcp4-mtp"


# ---- checks on constructed data -------------------------------------------------------------------------------


def test_check_lossless_constructed() -> None:
    plain = [[5, 6, 7, 8], [1, 2, 3]]
    ids = [torch.tensor([[5, 9], [6, 9], [7, 4], [8, 9]]), torch.tensor([[1, 0], [2, 0], [3, 0]])]
    near = [torch.tensor([[-0.1, -3.0], [-0.5, -0.5005], [-0.1, -3.0], [-0.1, -3.0]]), torch.zeros(3, 2)]
    assert check_lossless(plain, plain).verdict is Verdict.PASS
    tie = check_lossless([[5, 9, 7, 8], [1, 2, 3]], plain, LosslessSettings(), ids, near)
    assert tie.verdict is Verdict.PASS and tie.metrics["benign_divergences"] == 1
    clear = check_lossless([[5, 6, 4, 8], [1, 2, 3]], plain, LosslessSettings(), ids, near)
    assert clear.verdict is Verdict.FAIL and "token 2" in clear.reason
    short = check_lossless([[5, 6, 7], [1, 2, 3]], plain)
    assert short.verdict is Verdict.FAIL
    assert check_lossless([[1]], plain).verdict is Verdict.ERROR


def test_check_acceptance_constructed() -> None:
    ref = [[3, 0, 1, 2], [1, 1, 0]]
    assert histogram(ref, 3) == [2, 3, 1, 1]
    assert mean_accepted_length(ref) == pytest.approx((4 + 1 + 2 + 3 + 2 + 2 + 1) / 7)
    assert check_acceptance(ref, ref, 3).verdict is Verdict.PASS
    collapsed = check_acceptance(ref, [[0] * 8, [0] * 5], 3)
    assert collapsed.verdict is Verdict.FAIL and collapsed.metrics["mean_accepted_length"] == 1.0
    assert collapsed.metrics["reference_histogram"] == [2, 3, 1, 1]
    # same mean, different traces in every prompt: the speculator proposes differently
    swapped = check_acceptance(ref, [[2, 1, 0, 3], [0, 1, 1]], 3)
    assert swapped.verdict is Verdict.FAIL and "traces" in swapped.reason
    # one prompt of many differing by a step is within the tolerance
    many = [[1, 2]] * 9
    one_off = check_acceptance(many, many[:8] + [[2, 1]], 3)
    assert one_off.verdict is Verdict.PASS and one_off.metrics["traces_differ"] == 1
    assert check_acceptance(ref, [[0] * 8, [0] * 5], 3, AcceptanceSettings(abs_floor=2.0,
                            trace_fail_fraction=1.0)).verdict is Verdict.WARN  # tv distance only
    assert check_acceptance([[]], [[]], 3).verdict is Verdict.SKIP
    assert check_acceptance(ref, [[4], [0]], 3).verdict is Verdict.ERROR
    assert total_variation([1, 0], [0, 1]) == 1.0 and total_variation([2, 2], [1, 1]) == 0.0


def test_acceptance_traces_after_the_outputs_diverged_are_not_the_speculators() -> None:
    """A trace that differs at a verify step whose context the two outputs no longer share (the target took
    another token first, a near tie of a bf16 model: lossless and generation judge it) does not count; the same
    trace difference on a shared context still FAILs."""
    ref = [[1, 0, 0, 0], [0, 1, 0], [1, 1]]
    par = [[1, 0, 1, 0], [0, 1, 0], [1, 1]]  # prompt 0 differs at verify step 2 (its context: tokens 0-3)
    same = [list(range(10)), list(range(10))]
    other = [list(range(10)), [0, 1, 2, 99, 4, 5, 6, 7, 8, 9]]  # token 3 differs: step 2's context differs
    outputs_same = [(same[0], same[1])] * 3
    outputs_other = [(other[0], other[1])] + [(same[0], same[1])] * 2
    strict = AcceptanceSettings(trace_fail_fraction=0.25)
    failed = check_acceptance(ref, par, 3, strict, outputs=outputs_same)
    assert failed.verdict is Verdict.FAIL and failed.metrics["traces_differ"] == 1
    passed = check_acceptance(ref, par, 3, strict, outputs=outputs_other)
    assert passed.verdict is not Verdict.FAIL and passed.metrics["traces_differ"] == 0  # WARN: tv on 9 steps
    assert passed.metrics["traces_after_output_divergence"] == 1
    assert "1 more differ only after the outputs diverged" in passed.reason
