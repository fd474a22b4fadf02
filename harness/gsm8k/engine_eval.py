"""GSM8K on the reference engine inside a run: every rank evaluates the same requests in lockstep
(the LM reports rank 0 / world size 1 to lm-eval, so it does not shard them)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from harness.engine.engine import Engine
from harness.engine.generator import EngineGenerator
from harness.engine.tokenizer import Tokenizer
from harness.gsm8k.data import resolve_source
from harness.gsm8k.lm import Generator, HarnessLM
from harness.gsm8k.records import GSM8KResult
from harness.gsm8k.settings import GSM8KSettings
from harness.gsm8k.tasks import evaluate_with


def evaluate_generator(generator: Generator, settings: GSM8KSettings, data_path: str | Path | None,
                       max_length: int) -> GSM8KResult:
    """GSM8K (the suite's settings) through any Generator (the engine here, a server in http_eval),
    per-question records included."""
    lm = HarnessLM(generator, batch_size=settings.batch_size, max_gen_toks=settings.max_new_tokens,
                   max_length=max_length)
    return evaluate_with(lm, settings.task, resolve_source(data_path), limit=settings.limit,
                         num_fewshot=settings.num_fewshot, apply_chat_template=settings.chat_template,
                         fewshot_as_multiturn=settings.fewshot_as_multiturn)


def evaluate_engine(engine: Engine, tokenizer: Tokenizer, settings: GSM8KSettings,
                    data_path: str | Path | None) -> GSM8KResult:
    """GSM8K through the engine, recording the batch it ran: batch_size, or fewer where the KV pool's
    slots cap it (said in the log)."""
    generator = EngineGenerator(engine, tokenizer)
    result = evaluate_generator(generator, settings, data_path, engine.pool.max_seq_len)
    if generator.widest < settings.batch_size:
        print(f"GSM8K: batch_size={settings.batch_size} but the KV pool holds {engine.max_batch} sequences of "
              f"max_seq_len={engine.pool.max_seq_len} per rank: {generator.widest} at a time (raise kv_budget_mib "
              f"for more)", flush=True)
    return replace(result, batch=generator.widest)
