"""GSM8K on the reference engine inside a run: every rank evaluates the same requests in lockstep
(the LM reports rank 0 / world size 1 to lm-eval, so it does not shard them)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from harness.engine.runtime.engine import Engine
from harness.engine.runtime.generator import EngineGenerator
from harness.formats.tokenizer import Tokenizer
from harness.gsm8k.lm import evaluate_generator
from harness.gsm8k.records import GSM8KResult
from harness.gsm8k.settings import GSM8KSettings


def evaluate_engine(engine: Engine, tokenizer: Tokenizer, settings: GSM8KSettings,
                    data_path: str | Path | None) -> GSM8KResult:
    """GSM8K through the engine, recording the batch it ran: batch_size, or fewer where the KV pool's
    slots cap it (said in the log)."""
    generator = EngineGenerator(engine, tokenizer, settings.sampling)
    result = evaluate_generator(generator, settings, data_path, engine.pool.max_seq_len)
    if generator.widest < settings.batch_size:
        print(f"GSM8K: batch_size={settings.batch_size} but the KV pool holds {engine.max_batch} sequences of "
              f"max_seq_len={engine.pool.max_seq_len} per rank: {generator.widest} at a time (raise kv_budget_mib "
              f"for more)", flush=True)
    return replace(result, batch=generator.widest)
