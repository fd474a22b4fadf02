"""GSM8K against an engine server: the harness's own lm-eval model (HarnessLM) over a Generator that
sends token-id prompts through the run's HTTP dialect.

Why this and not lm-eval's `local-completions` model: the prompts are tokenized here exactly as for the
embedded engine (the same token ids reach every engine, so the paired McNemar check compares like with
like), stopping and cutting at stop strings is the same code, the requests reuse the backend's client,
timeouts and dialects (SGLang's native /generate included, which local-completions cannot speak), and
no tokenizer has to be resolved by name on the client side.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from harness.backends.http.dialects import Dialect
from harness.formats.tokenizer import Tokenizer
from harness.gsm8k.lm import evaluate_generator
from harness.gsm8k.records import GSM8KResult
from harness.gsm8k.settings import GSM8KSettings


class HttpGenerator:
    """The LM's Generator over a server: each batch of at most `max_batch` prompts is one request; the
    server stops every sequence at EOS or one of the LM's stop tokens, the LM cuts at stop strings."""

    rank = 0
    world_size = 1

    def __init__(self, dialect: Dialect, tokenizer: Tokenizer) -> None:
        self.dialect = dialect
        self.tokenizer = tokenizer

    def generate(self, prompts: list[list[int]], max_new_tokens: int, stop_token_ids: set[int],
                 stop_strings: Sequence[str] = (), max_batch: int | None = None) -> list[list[int]]:
        size = max_batch or len(prompts) or 1
        stop = sorted(stop_token_ids)
        out: list[list[int]] = []
        for start in range(0, len(prompts), size):
            out += self.dialect.complete(prompts[start:start + size], max_new_tokens, stop)
        return out


def evaluate_server(dialect: Dialect, tokenizer: Tokenizer, settings: GSM8KSettings, data_path: str | Path | None,
                    max_seq_len: int) -> GSM8KResult:
    """GSM8K (the suite's settings) on the server behind `dialect`, per-question records included."""
    return evaluate_generator(HttpGenerator(dialect, tokenizer), settings, data_path, max_seq_len)
