"""The engine as a text generator (the GSM8K LM's Generator protocol): every rank calls it in lockstep."""

from __future__ import annotations

from harness.engine.engine import Engine
from harness.engine.tokenizer import Tokenizer


class EngineGenerator:
    """Greedy batched generation through one rank's Engine; all ranks return the same tokens."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.rank = engine.state.rank
        self.world_size = engine.state.world_size

    def generate(self, prompts: list[list[int]], max_new_tokens: int, stop_token_ids: set[int]) -> list[list[int]]:
        return self.engine.generate(prompts, max_new_tokens, stop_token_ids=frozenset(stop_token_ids)).tokens
