"""Generation throughput features keep greedy output unchanged: continuous batching (finished slots
refilled), stop strings checked during generation, the GQA fast path of the fused attention."""

from __future__ import annotations

import pytest
import torch

from harness.engine.engine import Engine, PoolSettings
from harness.engine.generator import EngineGenerator
from harness.engine.model import fused_attention, grouped_kv, local_attention
from harness.engine.parallel import ParallelState
from harness.engine.tokenizer import load_tokenizer
from harness.engine.weights import load_weights
from harness.gsm8k.lm import cut_at_stop
from harness.specs.model import load_model

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
    alone = [generator.engine.generate([p], 10) for p in prompts]
    refilled = generator.engine.generate(prompts, 10, max_batch=2)  # 5 prompts through 2 slots
    for i, single in enumerate(alone):
        assert refilled.tokens[i] == single.tokens[0]
        torch.testing.assert_close(refilled.topk_logprobs[i], single.topk_logprobs[0], rtol=1e-4, atol=1e-4)
    assert not generator.engine.cache.seqs  # every slot was given back


def test_stop_check_ends_only_that_sequence(generator: EngineGenerator) -> None:
    prompts = _ids(generator)
    full = generator.engine.generate(prompts, 10).tokens
    cut = generator.engine.generate(prompts, 10, stop=lambda i, toks: i == 1 and len(toks) == 3).tokens
    assert cut[1] == full[1][:3]
    assert [c for i, c in enumerate(cut) if i != 1] == [f for i, f in enumerate(full) if i != 1]


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
        assert cut_at_stop(generator.tokenizer.decode(e), (stop,)) == cut_at_stop(generator.tokenizer.decode(f), (stop,))


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
