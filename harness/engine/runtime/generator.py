"""The engine as a text generator (the GSM8K LM's Generator protocol): every rank calls it in lockstep."""

from __future__ import annotations

from typing import Sequence

from harness.engine.runtime.engine import Engine
from harness.engine.runtime.sampler import Sampler
from harness.engine.runtime.scheduler import Lane, ServeSettings, ServingLoop, generate, shared_prefix_length
from harness.formats.tokenizer import Tokenizer
from harness.specs.sampling import SamplingParams

STOP_WINDOW_SLACK = 8  # tokens decoded beyond the longest stop string's length when checking for it


def stop_string_check(tokenizer: Tokenizer, stop_strings: Sequence[str]) -> "StringStop | None":
    """A per-step check that a sequence's new text contains a stop string (None when there are none)."""
    strings = tuple(s for s in stop_strings if s)
    return StringStop(tokenizer, strings) if strings else None


class StringStop:
    """Stops a sequence once the decoded tail of its new tokens contains a stop string. The tail spans
    more tokens than the longest stop string has characters, so a stop string is found on the step it
    completes (a token decodes to at least one character) and nothing is cut earlier than the text cut."""

    def __init__(self, tokenizer: Tokenizer, strings: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.strings = strings
        self.window = max(len(s) for s in strings) + STOP_WINDOW_SLACK

    def __call__(self, index: int, tokens: list[int]) -> bool:
        text = self.tokenizer.decode(tokens[-self.window:])
        return any(s in text for s in self.strings)


class EngineGenerator:
    """Greedy batched generation through one rank's Engine; all ranks return the same tokens. With `sampling`
    each prompt samples from its own generator (generate's `seeds`), every rank alike (the engine's sampler)."""

    samples = True  # takes seeds= (sampled GSM8K)

    def __init__(self, engine: Engine, tokenizer: Tokenizer, sampling: SamplingParams | None = None) -> None:
        self.engine = engine
        self.sampling = sampling
        self.prefix_cache = True  # the prompts' common prefix computed once, into the loop's prefix cache
        self.tokenizer = tokenizer
        self.rank = engine.state.rank
        self.world_size = engine.state.world_size
        self.widest = 0  # the most sequences any generate() call ran at once

    def generate(self, prompts: list[list[int]], max_new_tokens: int, stop_token_ids: set[int],
                 stop_strings: Sequence[str] = (), max_batch: int | None = None,
                 seeds: Sequence[int] = ()) -> list[list[int]]:
        # the prefix cache (and the pool slot it keeps free) only where the prompts share a whole virtual block
        shared = shared_prefix_length(prompts) >= self.engine.pool.block_size * self.engine.state.dcp
        settings = ServeSettings(prefix_cache=self.prefix_cache and shared, max_batch=max_batch or 0)
        stop = stop_string_check(self.tokenizer, stop_strings)
        if self.sampling is not None and seeds:  # each prompt draws from its own seeded generator
            state = self.engine.state
            sampler = Sampler.of(self.sampling, self.engine.spec.vocab, state.tp, state.rank,
                                 self.engine.flags.sampler_slip)
            lane = Lane(prompts, [max_new_tokens] * len(prompts), settings, frozenset(stop_token_ids), stop,
                        sampler=sampler, seeds=list(seeds))
            out = ServingLoop(self.engine).run([lane])[0][0]
        else:
            out = generate(self.engine, prompts, max_new_tokens, stop_token_ids=frozenset(stop_token_ids),
                           stop=stop, settings=settings)
        self.widest = max(self.widest, out.width)
        return out.tokens
