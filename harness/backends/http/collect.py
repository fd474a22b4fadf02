"""What an HTTP run asks a server and how the answers become the run directory's tensors: for each
case the teacher-forced top-k of its whole sequence (the prefill path) and a greedy generation from
its prompt with per-step top-k (decode steps through the server's KV cache)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch

from harness.backends.http.dialects import Dialect, Generation, Scored
from harness.backends.http.send import SendLog, SendSchedule, send
from harness.cases import build_cases, prompts_hash
from harness.formats.tokenizer import Tokenizer, load_tokenizer, tokenizer_hash
from harness.formats.weights import load_weights, weights_hash
from harness.records import contract as c
from harness.records.artifacts import Case
from harness.records.contract import Job
from harness.specs.model import ModelSpec
from harness.specs.sampling import SamplingParams


@dataclass(frozen=True)
class Collected:
    cases: list[Case]
    tensors: dict[str, torch.Tensor]
    weights_hash: str
    prompts_hash: str
    tokenizer_hash: str
    gsm8k: dict[str, Any] | None = None  # GSM8KResult.to_dict() when the job asks for GSM8K
    nonfinite: tuple[dict[str, Any], ...] = ()  # the non-finite logprobs answered (contract.MANIFEST_LOGPROB_VALUES)
    requests: dict[str, Any] | None = None  # SendLog.to_dict() when a request schedule sent the cases
    workloads: list[dict[str, Any]] | None = None  # the manifest's `workloads` entry of a run with workloads


def collect(job: Job, model: ModelSpec, dialect: Dialect, k: int, together: bool,
            schedule: SendSchedule | None = None) -> Collected:
    """Send every case of `job` to the server behind `dialect`: one request per case as `schedule` says
    (http_send), or without one all together in one request (`together`) or one by one."""
    tokenizer = load_tokenizer(model)
    cases = build_cases(job.prompts, tokenizer, job.seed, job.max_new_tokens, job.decode_prefix_tokens)
    log = SendLog(schedule) if schedule is not None else None
    scored, generated = send_cases(dialect, cases, k, job.max_new_tokens, job.top_k, together, log)
    return collect_answers(job, cases, scored, generated, tokenizer, log)


def collect_answers(job: Job, cases: Sequence[Case], scored: Sequence[Scored], generated: Sequence[Generation],
                    tokenizer: Tokenizer, log: SendLog | None = None) -> Collected:
    """The run's tensors and cases from each case's scores and generation (however they were asked)."""
    model = job.model
    tensors: dict[str, torch.Tensor] = {}
    done = []
    nonfinite = [{"case": case.index, "kind": kind, **bad} for case, s, g in zip(cases, scored, generated)
                 for kind, answer in ((c.PREFILL_TOPK_LOGPROBS, s), (c.GEN_TOPK_LOGPROBS, g))
                 for bad in answer.nonfinite]
    for case, s, g in zip(cases, scored, generated):
        key = lambda kind: c.tensor_key(kind, case.index)  # noqa: E731
        tensors.update({key(c.PREFILL_TOPK_IDS): s.ids, key(c.PREFILL_TOPK_LOGPROBS): s.logprobs,
                        key(c.GEN_TOKENS): g.tokens, key(c.GEN_TOPK_IDS): g.ids, key(c.GEN_TOPK_LOGPROBS): g.logprobs})
        tokens = [int(t) for t in g.tokens]
        done.append(replace(case, generated_ids=tuple(tokens), generated_text=tokenizer.decode(tokens)))
    return Collected(cases=done, tensors=tensors, weights_hash=weights_hash(load_weights(model)),
                     prompts_hash=prompts_hash(cases), tokenizer_hash=tokenizer_hash(tokenizer),
                     nonfinite=tuple(nonfinite), requests=log.to_dict() if log is not None else None)


def send_cases(dialect: Dialect, cases: Sequence[Case], k: int, max_new_tokens: int, top_k: int, together: bool,
               log: SendLog | None, sampling: SamplingParams | None = None,
               seeds: Sequence[int] = ()) -> tuple[list[Scored], list[Generation]]:
    """Each case's teacher-forced top-k (`k`) and generation (`max_new_tokens`, per-step `top_k`; greedy, or with
    `sampling` sampled from case i's seed seeds[i]), in case order: with a log, one request per case as its schedule
    says (recorded there); else all in one request (`together`) or one by one."""
    if log is None:
        return (dialect.score([case.sequence_ids for case in cases], k, together),
                dialect.generate([case.prompt_ids for case in cases], max_new_tokens, top_k, together, sampling,
                                 seeds))
    indices = [case.index for case in cases]
    scored = send("score", indices, [_one(dialect.score, case.sequence_ids, k) for case in cases], log.schedule, log)
    generated = send("generate", indices, [_one(dialect.generate, case.prompt_ids, max_new_tokens, top_k,
                                                sampling=sampling, seeds=seeds[j:j + 1] if sampling else ())
                                           for j, case in enumerate(cases)], log.schedule, log)
    return scored, generated


def _one(ask: Callable[..., list[Any]], ids: Sequence[int], *args: Any, **kwargs: Any) -> Callable[[], Any]:
    """A request of one case: `ask([ids], *args, together=True, **kwargs)`'s only answer."""
    return lambda: ask([ids], *args, True, **kwargs)[0]
