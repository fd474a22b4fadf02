"""The HTTP dialects without a server: answers are aligned by token id, never by list position, and a
top-k keyed by token strings is refused; the server side refuses bad requests with one clear message."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
import torch

from harness.backends.http.dialects import DIALECTS, SglangDialect, VllmDialect, token_id, topk_rows
from harness.core.errors import RunError
from harness.serve.dialects import BadRequest, Limits, Vocabulary, parse_completions, parse_generate
from harness.specs.engine import DIALECT_NAMES
from harness.specs.sampling import SamplingParams

VOCAB = Vocabulary(encode=lambda text: list(text.encode()),
                   decode=lambda ids: bytes(i for i in ids if i < 256).decode())
LIMITS = Limits(vocab=384, max_model_len=64, max_logprobs=5)


def test_the_dialect_names_a_template_takes_are_the_dialect_classes() -> None:
    assert tuple(DIALECTS) == DIALECT_NAMES  # a template's dialect is validated at load against the classes' names
    assert all(cls.name == name for name, cls in DIALECTS.items())


def test_topk_rows_sort_by_logprob_and_pad() -> None:
    ids, lps = topk_rows([{7: -2.0, 3: -0.5, 9: -0.5, 1: -9.0}, {4: -0.1}], k=3)
    assert ids.tolist() == [[3, 9, 7], [4, -1, -1]]  # ties broken by id; short rows padded with -1
    assert lps[0].tolist() == [-0.5, -0.5, -2.0] and lps[1, 0].item() == pytest.approx(-0.1)
    assert math.isinf(lps[1, 2].item())


def test_token_strings_are_refused() -> None:
    assert token_id("token_id:42") == 42
    with pytest.raises(RunError, match="collapses duplicates"):
        token_id(" the")


def _fake(answer: Any) -> tuple[list[tuple[str, dict]], Any]:
    sent: list[tuple[str, dict]] = []

    def post(path: str, body: dict) -> Any:
        sent.append((path, body))
        return answer
    return sent, post


def test_vllm_prompt_logprobs_aligned_by_id_with_the_prompt_token_beside_the_top_k() -> None:
    # position 1's entry lists the prompt token (rank 7) first, before the top-2: ids decide, not order
    answer = {"choices": [{"index": 0, "prompt_logprobs": [
        None, {"11": {"logprob": -6.0, "rank": 7}, "5": {"logprob": -0.2, "rank": 1},
               "6": {"logprob": -1.9, "rank": 2}},
        {"8": {"logprob": -0.3, "rank": 1}, "12": {"logprob": -0.9, "rank": 2}}],
        "logprobs": {"tokens": ["token_id:8"], "token_logprobs": [-0.1],
                     "top_logprobs": [{"token_id:8": -0.1, "token_id:2": -3.0}]}}]}
    sent, post = _fake(answer)
    scored = VllmDialect(post, "m").score([[10, 11, 12]], k=2, together=True)
    assert sent[0][1]["prompt"] == [[10, 11, 12]] and sent[0][1]["return_tokens_as_token_ids"] is True
    assert scored[0].ids.tolist() == [[5, 6], [8, 12], [8, 2]]
    assert torch.allclose(scored[0].logprobs, torch.tensor([[-0.2, -1.9], [-0.3, -0.9], [-0.1, -3.0]]))


def test_sglang_generate_reads_ids_from_the_logprob_triples() -> None:
    answer = [{"text": "", "output_ids": [4, 4], "meta_info": {
        "output_token_logprobs": [[-0.1, 4, None], [-0.2, 4, None]],
        "output_top_logprobs": [[[-0.1, 4, None], [-2.5, 9, None]], [[-0.2, 4, None], [-1.5, 3, None]]]}}]
    sent, post = _fake(answer)
    gen = SglangDialect(post, "m").generate([[1, 2]], n=2, k=2, together=True)[0]
    assert sent[0] == ("/generate", {"input_ids": [[1, 2]], "return_logprob": True, "top_logprobs_num": 2,
                                     "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}})
    assert gen.tokens.tolist() == [4, 4] and gen.ids.tolist() == [[4, 9], [4, 3]]


@pytest.mark.parametrize("body, message", [
    ({"prompt": [1, 999]}, r"token id 999 is out of range \[0, 384\)"),
    ({"prompt": [1, 2], "temperature": -0.5}, r"temperature=-0.5 must be >= 0 \(0: greedy\)"),
    ({"prompt": [1, 2], "temperature": 0.7, "top_p": 1.5}, r"top_p=1.5 must be in \(0, 1\]"),
    ({"prompt": [1, 2], "temperature": 0.7, "min_p": 1}, r"min_p=1.0 must be in \[0, 1\)"),
    ({"prompt": [1, 2], "temperature": 0.7, "repetition_penalty": 0}, "repetition_penalty=0.0 must be > 0"),
    ({"prompt": [1, 2], "temperature": 0.7, "top_k": -2}, "top_k=-2 must be an integer >= -1"),
    ({"prompt": [1, 2], "temperature": 0.7, "seed": -1}, "seed=-1 must be an integer >= 0"),
    ({"prompt": [1, 2], "temperature": "hot"}, "temperature='hot' must be a finite number"),
    ({"prompt": [1, 2], "n": 2}, "n=2 must be 1 with temperature 0"),
    ({"prompt": [1, 2], "temperature": 1, "n": 5000}, "n=5000 must be at most 1024"),
    ({"prompt": list(range(60)), "max_tokens": 10}, "exceeds max_model_len=64"),
    ({"prompt": [1], "logprobs": 9}, "at most max_logprobs=5"),
    ({"prompt": [1], "max_tokens": -1}, "max_tokens=-1 must be an integer >= 0"),
    ({}, "missing 'prompt'"),
])
def test_server_refuses_bad_completions(body: dict, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        parse_completions(body, VOCAB, LIMITS)


def test_server_parses_both_dialects_to_the_same_completion() -> None:
    vllm = parse_completions({"prompt": [[1, 2, 3]], "max_tokens": 4, "logprobs": 3, "prompt_logprobs": 3,
                              "ignore_eos": True}, VOCAB, LIMITS)
    sglang, batched = parse_generate({"input_ids": [[1, 2, 3]], "return_logprob": True, "logprob_start_len": 0,
                                      "top_logprobs_num": 3,
                                      "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}},
                                     VOCAB, LIMITS)
    assert batched and vllm == sglang
    text = parse_completions({"prompt": "hi", "max_tokens": 1}, VOCAB, LIMITS)
    assert text[0].prompt == [104, 105]


def test_stop_token_ids_travel_both_ways() -> None:
    # client: GSM8K's completions end at EOS or the LM's stop tokens (vLLM field, SGLang sampling param)
    answer = {"choices": [{"index": 0, "logprobs": {"tokens": ["token_id:7", "token_id:2"],
                                                    "top_logprobs": [{"token_id:7": -0.1}, {"token_id:2": -0.2}]}}]}
    sent, post = _fake(answer)
    assert VllmDialect(post, "m").complete([[1, 2]], 8, [2, 5]) == [[7, 2]]
    assert sent[0][1]["stop_token_ids"] == [2, 5] and sent[0][1]["ignore_eos"] is False
    sent, post = _fake([{"meta_info": {"output_token_logprobs": [[-0.1, 4, None]], "output_top_logprobs": [[]]}}])
    assert SglangDialect(post, "m").complete([[1, 2]], 8, [4]) == [[4]]
    assert sent[0][1]["sampling_params"]["stop_token_ids"] == [4]
    # server: both dialects parse them to the same completion; a bad id is one clear 400
    (vllm,) = parse_completions({"prompt": [[1, 2]], "max_tokens": 4, "stop_token_ids": [9, 3]}, VOCAB, LIMITS)
    (sglang,), _ = parse_generate({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4,
                                                                           "stop_token_ids": [3, 9]}}, VOCAB, LIMITS)
    assert vllm == sglang and vllm.stop_token_ids == (3, 9)
    with pytest.raises(BadRequest, match="stop token id 999 is out of range"):
        parse_completions({"prompt": [[1]], "stop_token_ids": [999]}, VOCAB, LIMITS)


def test_non_finite_and_null_logprobs_are_kept_as_answered_never_a_crash() -> None:
    # vLLM: a null logprob in prompt_logprobs and a NaN among the generated step's top logprobs
    answer = {"choices": [{"index": 0, "prompt_logprobs": [
        None, {"5": {"logprob": None, "rank": 1}, "6": {"logprob": -1.9, "rank": 2}}],
        "logprobs": {"tokens": ["token_id:8"], "token_logprobs": [-0.1],
                     "top_logprobs": [{"token_id:8": math.nan, "token_id:2": -3.0}]}}]}
    scored = VllmDialect(_fake(answer)[1], "m").score([[10, 11]], k=2, together=True)[0]
    assert scored.ids.tolist() == [[5, 6], [8, 2]]
    assert math.isnan(scored.logprobs[0, 0]) and math.isnan(scored.logprobs[1, 0])
    assert list(scored.nonfinite) == [{"row": 0, "token": 5, "value": "null"}, {"row": 1, "token": 8, "value": "NaN"}]
    # OpenAI echo: a null top logprob (the request that crashed in _score) and an infinite one
    echo = {"choices": [{"index": 0, "logprobs": {
        "tokens": ["token_id:10", "token_id:11", "token_id:3"], "token_logprobs": [None, -0.5, -0.2],
        "top_logprobs": [None, {"token_id:11": None, "token_id:4": -2.0}, {"token_id:3": -math.inf}]}}]}
    scored = DIALECTS["openai"](_fake(echo)[1], "m").score([[10, 11]], k=2, together=True)[0]
    assert list(scored.nonfinite) == [{"row": 0, "token": 11, "value": "null"},
                                      {"row": 1, "token": 3, "value": "-Infinity"}]
    assert scored.ids[0].tolist() == [11, 4]  # the NaN first: never cut off by k
    assert scored.ids[1].tolist() == [3, -1]  # so is an infinity
    # SGLang: a null logprob in a generated step's top logprobs (once dropped silently)
    sglang = [{"meta_info": {"output_token_logprobs": [[-0.1, 4, None]],
                             "output_top_logprobs": [[[None, 4, None], [-2.5, 9, None]]]}}]
    gen = SglangDialect(_fake(sglang)[1], "m").generate([[1, 2]], n=1, k=2, together=True)[0]
    assert gen.ids.tolist() == [[4, 9]] and list(gen.nonfinite) == [{"row": 0, "token": 4, "value": "null"}]


def test_a_logprob_that_is_not_a_number_is_one_clear_error() -> None:
    answer = {"choices": [{"index": 0, "logprobs": {"tokens": ["token_id:8"], "token_logprobs": [-0.1],
                                                    "top_logprobs": [{"token_id:8": "high"}]}}]}
    with pytest.raises(RunError, match="the server answered a logprob 'high', not a number"):
        VllmDialect(_fake(answer)[1], "m").generate([[1]], n=1, k=1, together=True)


def test_a_sampled_workloads_settings_travel_in_each_engines_own_names() -> None:
    """The client sends the settings under vLLM's / SGLang's names with each request's seed; harness serve parses
    both to the same SamplingParams, n completions seeded seed, seed + 1, ... (as vLLM seeds its children)."""
    params = SamplingParams(temperature=1.5, top_k=12, top_p=0.95, min_p=0.05, repetition_penalty=1.3,
                            presence_penalty=0.5, frequency_penalty=0.2, seed=7, n=3)
    answer = {"choices": [{"index": 0, "logprobs": {"tokens": ["token_id:7"], "top_logprobs": [{"token_id:7": -0.1}]}}]}
    sent, post = _fake(answer)
    gen = VllmDialect(post, "m", seed=0).generate([[1, 2]], 1, 1, together=True, sampling=params, seeds=[99])
    body = sent[0][1]
    assert gen[0].tokens.tolist() == [7]
    assert {k: body[k] for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                                 "frequency_penalty", "seed")} == {
        "temperature": 1.5, "top_k": 12, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.3,
        "presence_penalty": 0.5, "frequency_penalty": 0.2, "seed": 99}
    sent, post = _fake({"choices": [{"index": j, "logprobs": {"tokens": [f"token_id:{t}"], "top_logprobs": [{}]}}
                                    for j, t in enumerate((5, 6, 5))]})
    assert VllmDialect(post, "m").draw([1, 2, 3], replace(params, top_k=0), 40, 3) == [5, 6, 5]
    assert sent[0][1]["n"] == 3 and sent[0][1]["seed"] == 40 and sent[0][1]["top_k"] == -1
    (vllm,) = parse_completions({"prompt": [1, 2], "max_tokens": 1, **{k: body[k] for k in body if k != "prompt"}},
                                VOCAB, LIMITS)
    assert vllm.sampling == replace(params, seed=99, n=1)
    drawn = parse_completions(sent[0][1], VOCAB, LIMITS)
    assert [c.sampling.seed for c in drawn if c.sampling] == [40, 41, 42] and all(c.prompt == [1, 2, 3] for c in drawn)
    # SGLang: sampling_params with sampling_seed; draws as the prompt n times, one seeded params object each
    sent, post = _fake({"meta_info": {"output_token_logprobs": [[-0.1, 4, None]], "output_top_logprobs": [[]]}})
    SglangDialect(post, "m").generate([[1, 2]], 1, 1, together=True, sampling=params, seeds=[99])
    (sglang,), _ = parse_generate(sent[0][1], VOCAB, LIMITS)
    assert sglang.sampling == vllm.sampling and sent[0][1]["sampling_params"]["sampling_seed"] == 99
    sent, post = _fake([{"meta_info": {"output_token_logprobs": [[-0.1, t, None]]}} for t in (8, 9)])
    assert SglangDialect(post, "m").draw([1, 2], params, 40, 2) == [8, 9]
    parsed, batched = parse_generate(sent[0][1], VOCAB, LIMITS)
    assert batched and [c.sampling.seed for c in parsed if c.sampling] == [40, 41]
    assert parse_generate({"input_ids": [1], "sampling_params": {"temperature": 1, "n": 2, "sampling_seed": 5,
                                                             "max_new_tokens": 1}},
                          VOCAB, LIMITS)[0][1].sampling == SamplingParams(temperature=1.0, seed=6)
    # an engine that cannot take per-request seeds (template seeded_sampling: false): its sampled requests go unseeded
    # in both dialects (draws and generations); its greedy requests keep the run seed (it decides nothing there)
    sent: list[dict] = []

    def choices(path: str, body: dict) -> Any:
        sent.append(body)
        return {"choices": [{"index": j, "logprobs": {"tokens": ["token_id:5"], "top_logprobs": [{"token_id:5": -0.1}]}}
                            for j in range(body.get("n", 1))]}
    vllm_unseeded = VllmDialect(choices, "m", seed=3, seeded=False)
    vllm_unseeded.draw([1, 2], params, 40, 2)
    vllm_unseeded.generate([[1, 2]], 1, 1, together=True, sampling=replace(params, n=1), seeds=[99])
    vllm_unseeded.generate([[1, 2]], 1, 1, together=True)
    assert ["seed" in body for body in sent] == [False, False, True] and sent[2]["seed"] == 3
    sent, post = _fake([{"meta_info": {"output_token_logprobs": [[-0.1, 5, None]]}}] * 2)
    SglangDialect(post, "m", seeded=False).draw([1, 2], params, 40, 2)
    assert not any("sampling_seed" in p for p in sent[0][1]["sampling_params"]), sent
    with pytest.raises(BadRequest, match=r"sampling: top_p=0.0 must be in \(0, 1\]"):
        parse_generate({"input_ids": [1], "sampling_params": {"temperature": 1, "top_p": 0}}, VOCAB, LIMITS)
    with pytest.raises(BadRequest, match=r"a list of one object per prompt \(2\)"):
        parse_generate({"input_ids": [[1], [2]], "sampling_params": [{}]}, VOCAB, LIMITS)
