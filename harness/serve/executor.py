"""Run a batch of completions on one rank's engine. Every rank calls `execute` with the same batch in
the same order (lockstep) and gets the same results; only rank 0's are sent back to clients."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby
from typing import Sequence

import torch

from harness.engine.engine import Engine
from harness.engine.speculative import SpeculativeDecoder
from harness.serve.protocol import Completion, CompletionResult, TokenLogprob, TopK


@dataclass(frozen=True)
class Generated:
    tokens: list[int]
    logprobs: list[TokenLogprob]
    accepted: list[int]


def _top(logprobs: torch.Tensor, k: int) -> TopK:
    """The k best (id, logprob) of one row of logprobs [V]."""
    if k <= 0:
        return []
    top = torch.topk(logprobs, k=min(k, logprobs.shape[-1]))
    return [(int(i), float(v)) for i, v in zip(top.indices, top.values)]


def score(logprobs: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """`token` scored against one position's logprobs [V]: its logprob, 1-based rank and the top-k."""
    value = logprobs[token]
    rank = int((logprobs > value).sum()) + 1
    return TokenLogprob(token=token, logprob=float(value), rank=rank, top=_top(logprobs, k))


def teacher_forced(engine: Engine, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Float64 log-probabilities [T, V] of each whole sequence from one batched prefill."""
    return [torch.log_softmax(logits.double(), dim=-1) for logits in engine.prefill_logits(sequences)]


def _prompt_logprobs(engine: Engine, batch: Sequence[Completion]) -> list[list[TokenLogprob | None] | None]:
    wanted = [i for i, c in enumerate(batch) if c.prompt_top_k > 0]
    out: list[list[TokenLogprob | None] | None] = [None] * len(batch)
    rows = teacher_forced(engine, [batch[i].prompt for i in wanted]) if wanted else []
    for i, lp in zip(wanted, rows):
        c = batch[i]
        out[i] = [None, *(score(lp[t - 1], c.prompt[t], c.prompt_top_k) for t in range(1, len(c.prompt)))]
    return out


def _stop(c: Completion, eos_id: int | None) -> frozenset[int]:
    eos = frozenset() if c.ignore_eos or eos_id is None else frozenset({eos_id})
    return eos | frozenset(c.stop_token_ids)


def _plain(engine: Engine, group: list[Completion], stop: frozenset[int]) -> list[Generated]:
    gen = engine.generate([c.prompt for c in group], group[0].max_tokens, max(c.top_k for c in group) or 1, stop)
    out = []
    for c, toks, ids, lps in zip(group, gen.tokens, gen.topk_ids, gen.topk_logprobs):
        steps = [TokenLogprob(token=t, logprob=float(lp[0]), rank=1,
                              top=[(int(i), float(v)) for i, v in zip(ids_row[:c.top_k], lp[:c.top_k])])
                 for t, ids_row, lp in zip(toks, ids, lps)]
        out.append(Generated(list(toks), steps, []))
    return out


def _speculative(engine: Engine, decoder: SpeculativeDecoder, group: list[Completion],
                 stop: frozenset[int]) -> list[Generated]:
    """Tokens from speculative decoding; their logprobs from a teacher-forced pass over prompt + tokens
    (exact for greedy decoding: the same distributions the target verified)."""
    result = decoder.generate([c.prompt for c in group], group[0].max_tokens, stop)
    rows = teacher_forced(engine, [c.prompt + toks for c, toks in zip(group, result.tokens)])
    out = []
    for c, toks, acc, lp in zip(group, result.tokens, result.accepted, rows):
        base = len(c.prompt) - 1
        steps = [score(lp[base + j], t, c.top_k) for j, t in enumerate(toks)]
        out.append(Generated(list(toks), steps, list(acc)))
    return out


def execute(engine: Engine, batch: Sequence[Completion], eos_id: int | None,
            decoder: SpeculativeDecoder | None = None) -> list[CompletionResult]:
    """Every completion of `batch`; generations batched by (max_tokens, stop tokens)."""
    prompt_lps = _prompt_logprobs(engine, batch)
    generated: dict[int, Generated] = {}
    key = lambda i: (batch[i].max_tokens, sorted(_stop(batch[i], eos_id)))  # noqa: E731
    for (max_tokens, _), members in groupby(sorted(range(len(batch)), key=key), key=key):
        index = list(members)
        group = [batch[i] for i in index]
        stop = _stop(group[0], eos_id)
        if max_tokens == 0:
            done = [Generated([], [], []) for _ in group]
        elif decoder is not None:
            done = _speculative(engine, decoder, group, stop)
        else:
            done = _plain(engine, group, stop)
        generated.update(zip(index, done))
    results = []
    for i, c in enumerate(batch):
        g = generated[i]
        finish = "stop" if g.tokens and g.tokens[-1] in _stop(c, eos_id) else "length"
        k = decoder.k if decoder is not None else 0
        results.append(CompletionResult(
            tokens=g.tokens, logprobs=g.logprobs, prompt_logprobs=prompt_lps[i], finish_reason=finish,
            spec_steps=len(g.accepted), spec_draft_tokens=k * len(g.accepted),
            spec_accepted_tokens=sum(g.accepted), accepted_per_step=g.accepted))
    return results
