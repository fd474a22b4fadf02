"""The inputs of a run: one Case per prompt, built the same way on every rank and every run."""

from __future__ import annotations

import hashlib
import json
from typing import Sequence

import numpy as np

from harness.artifacts import Case
from harness.engine.tokenizer import Tokenizer

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
