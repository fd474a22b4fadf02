"""The inputs of a run: one Case per prompt, built the same way on every rank and every run."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np

from harness.formats.tokenizer import Tokenizer
from harness.records.artifacts import Case
from harness.specs.workload import Workload, WorkloadPlan

PRINTABLE = np.array(list(" etaoinshrdlucmfwypvbgkjqxz.,ETAOINSHRDLU0123456789"))
N_PROBES = 4
RAGGED_SPREAD = 3  # decode starts of consecutive prompts differ by up to this many tokens - 1


def continuation_ids(tokenizer: Tokenizer, seed: int, index: int, n_tokens: int) -> list[int]:
    """A fixed, seeded continuation of exactly n_tokens tokens (text of printable characters)."""
    rng = np.random.default_rng([seed, index])
    ids: list[int] = []
    while len(ids) < n_tokens:
        ids += tokenizer.encode("".join(rng.choice(PRINTABLE, size=8 * n_tokens)))
    return ids[:n_tokens]


def probe_positions(start: int, end: int, n: int = N_PROBES) -> tuple[int, ...]:
    """Up to n decode positions in [start, end), evenly spread, always including end - 1."""
    span = end - start
    if span <= 0:
        return ()
    picks = {start + (span - 1) * k // max(1, n - 1) for k in range(n)} if span > 1 else {start}
    return tuple(sorted(picks))


def ragged_decode_start(index: int, decode_prefix_tokens: int, prompt_len: int) -> int:
    """Where prompt `index`'s decode path starts: decode_prefix_tokens, minus 0, 1 or 2 by index, within
    [1, prompt_len]. The decode path's prefill batch is then ragged (right-padded chunks) and each
    decode step feeds sequences at different positions (different DCP token owners), as a server does."""
    return max(1, min(decode_prefix_tokens - index % RAGGED_SPREAD, prompt_len))


def build_cases(prompts: Sequence[str], tokenizer: Tokenizer, seed: int, continuation_tokens: int,
                decode_prefix_tokens: int) -> list[Case]:
    """Teacher-forced sequence = prompt + seeded continuation; the decode path starts after
    about `decode_prefix_tokens` tokens (ragged, see ragged_decode_start; at most the prompt), so most of
    the sequence goes through decode."""
    cases = []
    for i, prompt in enumerate(prompts):
        prompt_ids = tokenizer.encode(prompt)
        if not prompt_ids:
            prompt_ids = tokenizer.encode(" ")
        sequence = prompt_ids + continuation_ids(tokenizer, seed, i, continuation_tokens)
        start = ragged_decode_start(i, decode_prefix_tokens, len(prompt_ids))
        cases.append(Case(index=i, prompt=prompt, prompt_ids=tuple(prompt_ids), sequence_ids=tuple(sequence),
                          decode_start=start, probe_positions=probe_positions(start, len(sequence))))
    return cases


def prompts_hash(cases: Sequence[Case]) -> str:
    """sha256 of the teacher-forced token id sequences (the manifest's prompts_hash, compared by the
    inputs check; every backend computes it here so equal inputs hash equally)."""
    return hashlib.sha256(json.dumps([list(case.sequence_ids) for case in cases]).encode()).hexdigest()


PREFIX_STREAM = 1_000_003  # continuation_ids index of a workload's shared prefix (no prompt index reaches it)
PROMPT_STREAM = 2_000_003  # ... and offset of its own prompt tokens (distinct from the continuations)
DECODE_TAIL = 2            # a workload case's decode path starts this many tokens before its prompt's end


@dataclass(frozen=True)
class WorkloadCases:
    """The cases of one workload within a run: their indices run on from the previous workload's."""

    workload: Workload
    cases: tuple[Case, ...]

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(c.index for c in self.cases)


def _length_cases(w: Workload, tokenizer: Tokenizer, seed: int, first: int, salt: int) -> list[Case]:
    """Seeded prompts of exactly w.prompt_lengths() tokens (shared prefix first), each followed by a
    continuation of w.new_tokens tokens; the decode path starts DECODE_TAIL tokens before the prompt's end."""
    prefix = continuation_ids(tokenizer, seed, PREFIX_STREAM + salt, w.shared_prefix) if w.shared_prefix else []
    own = [prefix + continuation_ids(tokenizer, seed, PROMPT_STREAM + salt * 1000 + j, n)
           for j, n in enumerate(w.lengths)]
    prompts = [own[j] for j in w.sent()]
    cases = []
    for j, ids in enumerate(prompts):
        index = first + j
        sequence = ids + continuation_ids(tokenizer, seed, index, w.new_tokens)
        start = max(1, len(ids) - DECODE_TAIL)
        cases.append(Case(index=index, prompt=tokenizer.decode(ids), prompt_ids=tuple(ids),
                          sequence_ids=tuple(sequence), decode_start=start,
                          probe_positions=probe_positions(start, len(sequence))))
    return cases


def build_workload_cases(plan: WorkloadPlan, prompts: Sequence[str], tokenizer: Tokenizer, seed: int,
                         decode_prefix_tokens: int) -> list[WorkloadCases]:
    """Every case of a run with workloads, per workload in plan order, indices consecutive: the suite's
    prompts workload as build_cases makes them, the others as seeded prompts of exact token lengths."""
    out: list[WorkloadCases] = []
    first = 0
    for salt, w in enumerate(plan.workloads):
        if w.suite_prompts:
            cases = [replace(c, index=first + c.index)
                     for c in build_cases(prompts, tokenizer, seed, w.new_tokens, decode_prefix_tokens)]
        else:
            cases = _length_cases(w, tokenizer, seed, first, salt)
        out.append(WorkloadCases(w, tuple(cases)))
        first += len(cases)
    return out


def workload_manifest(groups: Sequence[WorkloadCases]) -> list[dict[str, Any]]:
    """The manifest's `workloads` entry: each workload, its engine settings and its cases with their
    token counts (tokens = prompt + continuation)."""
    return [{"name": g.workload.name, "schedule": g.workload.schedule, "join_per_step": g.workload.join_per_step,
             "route": g.workload.route, "settings": g.workload.engine_settings(),
             **({"sampling": g.workload.sampling.to_dict()} if g.workload.sampling is not None else {}),
             "cases": [{"index": c.index, "prompt_tokens": len(c.prompt_ids),
                        "continuation_tokens": len(c.sequence_ids) - len(c.prompt_ids),
                        "tokens": len(c.sequence_ids)} for c in g.cases]} for g in groups]
