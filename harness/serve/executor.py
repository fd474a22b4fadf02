"""Run a batch of completions on one rank's engine. Every rank calls `execute` with the same batch in
the same order (lockstep) and gets the same results; only rank 0's are sent back to clients."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from itertools import groupby
from typing import Callable, Sequence

import torch

from harness.engine.runtime.engine import Engine, PrefixLoader
from harness.engine.runtime.scheduler import generate, sampler_for, speculate
from harness.engine.speculative.decoding import SpeculativeDecoder
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


Abandoned = Callable[[], frozenset[int]]  # indices of the batch nobody waits for (alike on every rank)


def _nothing_abandoned() -> frozenset[int]:
    return frozenset()


def _prompt_logprobs(engine: Engine, batch: Sequence[Completion],
                     gone: frozenset[int]) -> list[list[TokenLogprob | None] | None]:
    wanted = [i for i, c in enumerate(batch) if c.prompt_top_k > 0 and i not in gone]
    out: list[list[TokenLogprob | None] | None] = [None] * len(batch)
    rows = teacher_forced(engine, [batch[i].prompt for i in wanted]) if wanted else []
    for i, lp in zip(wanted, rows):
        c = batch[i]
        out[i] = [None, *(score(lp[t - 1], c.prompt[t], c.prompt_top_k) for t in range(1, len(c.prompt)))]
    return out


def _stop(c: Completion, eos_id: int | None) -> frozenset[int]:
    eos = frozenset() if c.ignore_eos or eos_id is None else frozenset({eos_id})
    return eos | frozenset(c.stop_token_ids)


# a generation group's KV source of each prompt (a disaggregated decode server: harness/serve/pd.py), or None
Loaders = Callable[[list[Completion]], PrefixLoader | None]


def _no_loader(group: list[Completion]) -> PrefixLoader | None:
    return None


def _sampling_key(c: Completion) -> tuple[float, ...]:
    """What a sampled completion shares with the others of its lane: its settings but the seed (greedy: ())."""
    if c.sampling is None:
        return ()
    return tuple(float(v) for v in replace(c.sampling, seed=0, n=1).to_dict().values())


def _plain(engine: Engine, group: list[Completion], stop: frozenset[int], gone: Abandoned,
           loader: PrefixLoader | None = None) -> list[Generated]:
    """A greedy group, or a sampled one (every completion the same settings, each its own seed) drawn by the engine's
    sampler; a sampled step's logprob is the drawn token's (any rank), read from the whole vocabulary's row."""
    params = group[0].sampling
    if params is not None:
        gen = generate(engine, [c.prompt for c in group], group[0].max_tokens, engine.spec.vocab, stop,
                       abandoned=gone, loader=loader, sampler=sampler_for(engine, params),
                       seeds=[c.sampling.seed for c in group if c.sampling is not None])
    else:
        gen = generate(engine, [c.prompt for c in group], group[0].max_tokens, max(c.top_k for c in group) or 1,
                       stop, abandoned=gone, loader=loader)
    out = []
    for c, toks, ids, lps in zip(group, gen.tokens, gen.topk_ids, gen.topk_logprobs):
        if params is not None:  # the whole row [V]: the drawn token scored against it
            rows = [torch.full((engine.spec.vocab,), -math.inf, dtype=torch.float64).index_put((i,), lp.double())
                    for i, lp in zip(ids, lps)]
            steps = [score(row, t, c.top_k) for t, row in zip(toks, rows)]
        else:
            steps = [TokenLogprob(token=t, logprob=float(lp[0]), rank=1,
                                  top=[(int(i), float(v)) for i, v in zip(ids_row[:c.top_k], lp[:c.top_k])])
                     for t, ids_row, lp in zip(toks, ids, lps)]
        out.append(Generated(list(toks), steps, []))
    return out


def _speculative(engine: Engine, decoder: SpeculativeDecoder, group: list[Completion],
                 stop: frozenset[int], gone: Abandoned) -> list[Generated]:
    """Tokens from speculative decoding; their logprobs from a teacher-forced pass over prompt + tokens
    (exact for greedy decoding: the same distributions the target verified). Abandoned completions get
    no logprobs."""
    result = speculate(decoder, [c.prompt for c in group], group[0].max_tokens, stop, abandoned=gone)
    dropped = gone()
    kept = [j for j in range(len(group)) if j not in dropped]
    rows = dict(zip(kept, teacher_forced(engine, [group[j].prompt + result.tokens[j] for j in kept])))
    out = []
    for j, (c, toks, acc) in enumerate(zip(group, result.tokens, result.accepted)):
        if j not in rows:
            out.append(Generated(list(toks), [], list(acc)))
            continue
        lp, base = rows[j], len(c.prompt) - 1
        # the spec-logprob-shift fault: each step scored on the row after its own (the last row stays)
        shift = 1 if engine.flags.spec_logprob_shift else 0
        steps = [score(lp[min(base + j + shift, lp.shape[0] - 1)], t, c.top_k) for j, t in enumerate(toks)]
        out.append(Generated(list(toks), steps, list(acc)))
    return out


def execute(engine: Engine, batch: Sequence[Completion], eos_id: int | None,
            decoder: SpeculativeDecoder | None = None,
            abandoned: Abandoned = _nothing_abandoned, loaders: Loaders = _no_loader) -> list[CompletionResult]:
    """Every completion of `batch`; generations batched by (max_tokens, stop tokens, sampling settings but the
    seed). `abandoned()` (asked
    before the prompt pass and every generation step, alike on every rank) names completions nobody waits for:
    they are skipped or stopped at that step, and their results are partial. `loaders(group)`: the KV source of a
    plain generation group's prompts (a disaggregated decode server's connector), or None to compute them."""
    prompt_lps = _prompt_logprobs(engine, batch, abandoned())
    generated: dict[int, Generated] = {}
    key = lambda i: (batch[i].max_tokens, sorted(_stop(batch[i], eos_id)), _sampling_key(batch[i]))  # noqa: E731
    for (max_tokens, _, _), members in groupby(sorted(range(len(batch)), key=key), key=key):
        index = list(members)
        group = [batch[i] for i in index]
        stop = _stop(group[0], eos_id)

        def local(index: list[int] = index) -> frozenset[int]:  # the group's own positions of abandoned ones
            gone = abandoned()
            return frozenset(j for j, i in enumerate(index) if i in gone)

        if max_tokens == 0:
            done = [Generated([], [], []) for _ in group]
        elif decoder is not None:
            done = _speculative(engine, decoder, group, stop, local)
        else:
            done = _plain(engine, group, stop, local, loaders(group))
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
