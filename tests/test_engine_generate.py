"""Generation throughput features keep greedy output unchanged: continuous batching (finished slots
refilled), stop strings checked during generation, the GQA fast path of the fused attention, the
mask-free / causal kernel calls, cached RoPE tables, fused projections and shared-prefix KV reuse (the
prefix cache). The one generation loop (the serving loop at default settings) gives the tokens the
engine's former generation loops gave, on every shipped model and topology family."""

from __future__ import annotations

import json

import pytest
import torch

from harness.engine.layers.dense import (
    RopeCache,
    attention_with_lse,
    fused_attention,
    grouped_kv,
    local_attention,
    mask_kind,
    rope_tables,
)
from harness.engine.runtime.engine import Engine
from harness.engine.runtime.generator import EngineGenerator
from harness.engine.runtime.kvcache import PagedKVCache, zeroed
from harness.engine.runtime.parallel import ParallelState
from harness.engine.runtime.scheduler import ServeSettings, generate, shared_prefix_length
from harness.engine.speculative.decoding import SpeculativeDecoder
from harness.formats.locate import load_model
from harness.formats.tokenizer import load_tokenizer
from harness.formats.weights import load_weights
from harness.gsm8k.lm import cut_at_stop
from harness.specs.pool import PoolSettings
from harness.specs.topology import parse_topology_name
from tests.generation_fixture import CASES, FIXTURE, record

TWO = ServeSettings(max_batch=2)
PROMPTS = ["Question: What is 2 + 3?\nAnswer:", "Hi", "A long prompt about ducks and eggs. " * 3, "Q: 7 * 6 = ?\nA:",
           "one two three"]


@pytest.fixture(scope="module")
def generator() -> EngineGenerator:
    spec = load_model("tiny-gqa")
    engine = Engine(spec, load_weights(spec), ParallelState.single(), pool=PoolSettings(max_seq_len=256))
    return EngineGenerator(engine, load_tokenizer(spec))


def _ids(generator: EngineGenerator) -> list[list[int]]:
    return [generator.tokenizer.encode(p) for p in PROMPTS]


def test_continuous_batching_matches_one_prompt_at_a_time(generator: EngineGenerator) -> None:
    prompts = _ids(generator)
    alone = [generate(generator.engine, [p], 10) for p in prompts]
    refilled = generate(generator.engine, prompts, 10, settings=TWO)  # 5 prompts through 2 slots
    for i, single in enumerate(alone):
        assert refilled.tokens[i] == single.tokens[0]
        torch.testing.assert_close(refilled.topk_logprobs[i], single.topk_logprobs[0], rtol=1e-4, atol=1e-4)
    assert not generator.engine.cache.seqs  # every slot was given back


def test_stop_check_ends_only_that_sequence(generator: EngineGenerator) -> None:
    prompts = _ids(generator)
    full = generate(generator.engine, prompts, 10).tokens
    cut = generate(generator.engine, prompts, 10, stop=lambda i, toks: i == 1 and len(toks) == 3).tokens
    assert cut[1] == full[1][:3]
    assert [c for i, c in enumerate(cut) if i != 1] == [f for i, f in enumerate(full) if i != 1]


def test_abandoned_prompts_stop_at_once_running_or_queued(generator: EngineGenerator) -> None:
    """What `harness serve` does with a request whose client went away: asked before every step, the hook's
    prompts stop there (a running one keeps its tokens so far, a queued one never starts); others are unchanged."""
    prompts = _ids(generator)
    full = generate(generator.engine, prompts, 10, settings=TWO).tokens
    steps = []

    def abandoned() -> set[int]:
        steps.append(1)
        return {0, 4} if len(steps) > 3 else set()  # prompt 0 runs from the start; 4 waits for a slot

    cut = generate(generator.engine, prompts, 10, abandoned=abandoned, settings=TWO)
    assert cut.tokens[0] == full[0][:3] and cut.tokens[4] == [] and cut.topk_ids[4].shape[0] == 0
    assert cut.tokens[1:4] == full[1:4]
    assert not generator.engine.cache.seqs  # the dropped sequences' slots were given back


def test_stop_strings_end_generation_early_with_the_same_cut_text(generator: EngineGenerator) -> None:
    prompts = _ids(generator)
    full = generator.generate(prompts, 24, set())
    texts = [generator.tokenizer.decode(t) for t in full]
    stop = texts[0][4:7]  # a string the first continuation contains
    assert stop and stop in texts[0]
    early = generator.generate(prompts, 24, set(), stop_strings=(stop,), max_batch=3)
    assert len(early[0]) < len(full[0])
    for e, f in zip(early, full):
        assert f[:len(e)] == e
        assert (cut_at_stop(generator.tokenizer.decode(e), (stop,))
                == cut_at_stop(generator.tokenizer.decode(f), (stop,)))


@pytest.mark.parametrize(("kv_index", "grouped"), [((0, 0, 1, 1), True), ((0, 1, 0, 1), False), ((0, 1, 2, 3), True)])
def test_fused_attention_gqa_path_equals_explicit_attention(kv_index: tuple[int, ...], grouped: bool) -> None:
    g = torch.Generator().manual_seed(0)
    n_kv = max(kv_index) + 1
    q = torch.randn(2, 3, 4, 8, generator=g)  # [B, S, Hq, hd]
    k, v = torch.randn(2, 5, n_kv, 8, generator=g), torch.randn(2, 5, n_kv, 8, generator=g)  # [B, L, Hkv, hd]
    mask = torch.ones(2, 3, 5, dtype=torch.bool).tril(diagonal=2)
    mask[1, 2] = False  # a padding query
    assert grouped_kv(kv_index, n_kv) is grouped
    expected, _ = local_attention(q, k, v, mask, kv_index)
    torch.testing.assert_close(fused_attention(q, k, v, mask, kv_index), expected, rtol=1e-5, atol=1e-5)


def test_shared_prefix_is_computed_once_and_keeps_generations(generator: EngineGenerator,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    engine = generator.engine
    shots = generator.tokenizer.encode("Question: 1 + 1?\nAnswer: 2\n\nQuestion: 2 + 2?\nAnswer: 4\n\n" * 2)
    prompts = [shots + generator.tokenizer.encode(q) for q in ("Question: 3 + 4?\nAnswer:", "Question: 9?",
                                                               "Question: ducks and eggs, how many?\nAnswer:")]
    shared = shared_prefix_length(prompts) // engine.pool.block_size * engine.pool.block_size  # whole blocks
    assert shared >= engine.pool.block_size
    fed: list[int] = []
    hidden = engine.decoder.hidden
    monkeypatch.setattr(engine.decoder, "hidden",
                        lambda batch, *a, **k: fed.append(int(batch.valid.sum())) or hidden(batch, *a, **k))
    plain = generate(engine, prompts, 12, settings=TWO)
    plain_fed, fed[:] = sum(fed), []
    reused = generate(engine, prompts, 12, settings=ServeSettings(prefix_cache=True, max_batch=2))
    assert plain_fed - sum(fed) == shared * (len(prompts) - 1)  # the prefix went through the model once
    assert reused.tokens == plain.tokens
    for a, b in zip(reused.topk_logprobs, plain.topk_logprobs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert not engine.cache.seqs and engine.cache.free_blocks == engine.capacity.blocks  # the prefix's too


def test_shared_prefix_leaves_each_prompt_a_token() -> None:
    assert shared_prefix_length([[1, 2, 3], [1, 2, 3, 4]]) == 2
    assert shared_prefix_length([[1, 2, 3]]) == 0
    assert shared_prefix_length([[5, 2], [1, 2]]) == 0


def _world(topology: str) -> str:
    """The launch a fixture case runs in (record(): tp1 here, the others one launch per (tp, dcp))."""
    topo = parse_topology_name(topology)
    return f"tp{topo.tp}dcp{topo.dcp}"


WORLDS = sorted({_world(t) for _, t in CASES})


def test_the_fixture_holds_every_case() -> None:
    assert list(json.loads(FIXTURE.read_text())["cases"]) == [f"{m} {t}" for m, t in CASES]


@pytest.mark.parametrize("world", WORLDS)
def test_one_loop_reproduces_the_former_generations_on_every_model_and_topology(world: str) -> None:
    """tests/data/generations.json holds the tokens of the former Engine.generate and speculative loop
    (tests/generation_fixture.py): dense GQA, odd GQA, MQA, MLA, hybrid, bf16/fp16 models over tp1, tp2,
    DCP (round-robin, interleaved, contiguous, Q replicated), EP, -draft and -mtp; one launch world per test."""
    cases = tuple((m, t) for m, t in CASES if _world(t) == world)
    recorded = json.loads(FIXTURE.read_text())["cases"]
    want = {f"{m} {t}": recorded[f"{m} {t}"] for m, t in cases}
    got = record(cases)
    for case, expected in want.items():
        hits = got[case].pop("prefix_hits")
        # the prefix cache splits the prefill where the former shared-prefix copy did (a 32-token prefix:
        # whole KV blocks up to dcp 2), and not at all where it takes no blocks (hybrid, contiguous, dcp 4)
        expected = {**expected, "shared": expected["shared"] if hits else expected["shared_plain"]}
        assert got[case] == expected, case  # plain tokens; speculative tokens and per-step acceptance
    if "tiny-bf16-big tp2" in want:
        # where the split changes the numerics (bf16), the cached path still gives the former copy's tokens
        assert want["tiny-bf16-big tp2"]["shared"] != want["tiny-bf16-big tp2"]["shared_plain"]
        assert got["tiny-bf16-big tp2"]["shared"] == want["tiny-bf16-big tp2"]["shared"]


def test_the_serving_loop_is_the_only_generation_loop() -> None:
    """Plain, served, GSM8K, workload and speculative generation all step through scheduler.ServingLoop."""
    assert "generate" not in vars(Engine) and "generate" not in vars(SpeculativeDecoder)
    assert "fork" not in vars(PagedKVCache)  # the shared-prefix copy became the prefix cache


def test_mask_free_and_causal_kernel_calls_equal_the_masked_one() -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 4, 8, generator=g) for _ in range(3))  # [B, S = L, H, hd]
    causal = torch.ones(4, 4, dtype=torch.bool).tril().expand(2, 4, 4)
    every = torch.ones(2, 4, 4, dtype=torch.bool)
    assert (mask_kind(causal), mask_kind(every), mask_kind(causal[:, :, :3])) == ("causal", "all", "mask")
    for mask in (causal, every):
        torch.testing.assert_close(fused_attention(q, k, v, mask, (0, 1, 2, 3), mask_kind(mask)),
                                   fused_attention(q, k, v, mask, (0, 1, 2, 3)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_a_zeroed_pool_reads_zero_and_keeps_what_is_written(dtype: torch.dtype) -> None:
    """Pools come from fresh anonymous pages (zero until written, nothing written at creation): every element
    reads 0, writes land where indexed, and the memory outlives every name for the mapping."""
    pool = zeroed((64, 16, 2, 8), dtype, "cpu")  # [blocks, block, heads, hd]
    assert pool.shape == (64, 16, 2, 8) and pool.dtype == dtype and pool.is_contiguous()
    assert not pool.any()
    pool[3, 5] = 7
    pool.view(-1, 8)[1000] += 1  # [blocks * block * heads, hd]
    expect = torch.zeros(64, 16, 2, 8, dtype=dtype)
    expect[3, 5] = 7
    expect.view(-1, 8)[1000] += 1
    assert torch.equal(pool, expect)
    assert zeroed((0, 4), dtype, "cpu").shape == (0, 4)


def test_cached_rope_tables_equal_direct_ones() -> None:
    positions = torch.tensor([[0, 5, 300], [7, 8, 9]])  # past the first table size: the cache grows
    cache = RopeCache(16, 10000.0)
    for dtype in (torch.float32, torch.bfloat16):
        for got, want in zip(cache.tables(positions, dtype), rope_tables(positions, 16, 10000.0, dtype)):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_fused_attention_with_lse_equals_explicit_attention() -> None:
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 3, 4, 8, generator=g)  # [B, S, Hq, hd]
    k, v = torch.randn(2, 5, 2, 8, generator=g), torch.randn(2, 5, 2, 8, generator=g)  # [B, L, Hkv, hd]
    mask = torch.ones(2, 3, 5, dtype=torch.bool).tril(diagonal=2)
    mask[1, 2] = False  # a query with no visible key (padding, or no token on this DCP rank)
    for kv_index in ((0, 0, 1, 1), (1, 0, 1, 0)):
        want_out, want_lse = local_attention(q, k, v, mask, kv_index)
        out, lse = attention_with_lse(q, k, v, mask, kv_index)
        torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)  # -inf where blind, on both
    every = torch.ones(2, 3, 5, dtype=torch.bool)
    for got, want in zip(attention_with_lse(q, k, v, every, (0, 0, 1, 1), mask_kind(every)),
                         local_attention(q, k, v, every, (0, 0, 1, 1))):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
