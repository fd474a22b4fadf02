"""Request parsing and response building for the two HTTP dialects `harness serve` speaks.

- vLLM's OpenAI-compatible /v1/completions: token-id (or text) prompts, `prompt_logprobs`,
  `logprobs`, `echo`, `return_tokens_as_token_ids`, `ignore_eos`, `stop_token_ids`;
- SGLang's native /generate: `input_ids` (or `text`), `sampling_params` (incl. `stop_token_ids`; one object, or a
  list of one per prompt), `return_logprob`, `logprob_start_len`, `top_logprobs_num`.
Sampling, in each engine's own names (vLLM's at the request's top level, SGLang's in `sampling_params`):
`temperature` (0 or absent: greedy), `top_k` (-1 or 0: off), `top_p`, `min_p`, `repetition_penalty`,
`presence_penalty`, `frequency_penalty`, the request's seed (vLLM `seed`, SGLang `sampling_seed`; absent: one drawn
by the server) and `n` completions per prompt, completion j seeded with seed + j (as vLLM seeds its n children).
The values are validated by harness/specs/sampling.py's SamplingParams, so a bad one is a 400 naming the field and
its valid range.
Pure functions: a bad request raises BadRequest with the message the client gets (HTTP 400).
"""

from __future__ import annotations

import math
import re
import secrets
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from harness.core.errors import ConfigError
from harness.serve.protocol import Completion, CompletionResult, KVTransfer, TokenLogprob
from harness.specs.sampling import SamplingParams

DEFAULT_MAX_TOKENS_VLLM = 16
DEFAULT_MAX_TOKENS_SGLANG = 128
MAX_N = 1024  # completions per prompt (`n`) one request may ask for
SEED_RANGE = 2 ** 62  # a server-drawn seed of a sampled request without one


class BadRequest(ValueError):
    """A request the server refuses (HTTP 400); the message names the bad field and what is valid."""


@dataclass(frozen=True)
class Limits:
    vocab: int
    max_model_len: int
    max_logprobs: int


@dataclass(frozen=True)
class Vocabulary:
    """Token id -> text, and text -> token ids (the model's tokenizer)."""

    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]


def _int(body: dict[str, Any], key: str, default: int | None, minimum: int = 0) -> int | None:
    value = body.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise BadRequest(f"{key}={value!r} must be an integer >= {minimum}")
    return value


def _number(where: dict[str, Any], key: str, default: float) -> float:
    value = where.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRequest(f"{key}={value!r} must be a finite number")
    return float(value)


def _sampling(where: dict[str, Any], seed_key: str) -> list[SamplingParams | None]:
    """The settings of each of a prompt's `n` completions (module docstring): [None] when greedy; sampled ones
    seeded seed, seed + 1, ..."""
    temperature = _number(where, "temperature", 0.0)
    n = _int(where, "n", 1, minimum=1) or 1
    if n > MAX_N:
        raise BadRequest(f"n={n} must be at most {MAX_N}")
    if temperature < 0:
        raise BadRequest(f"temperature={temperature:g} must be >= 0 (0: greedy)")
    if temperature == 0:
        if n != 1:
            raise BadRequest(f"n={n} must be 1 with temperature 0 (greedy decoding gives one answer)")
        return [None]
    top_k = _int(where, "top_k", -1, minimum=-1) or 0
    seed = _int(where, seed_key, None)
    try:
        params = SamplingParams(temperature=temperature, top_k=max(top_k, 0), top_p=_number(where, "top_p", 1.0),
                                min_p=_number(where, "min_p", 0.0),
                                repetition_penalty=_number(where, "repetition_penalty", 1.0),
                                presence_penalty=_number(where, "presence_penalty", 0.0),
                                frequency_penalty=_number(where, "frequency_penalty", 0.0),
                                seed=secrets.randbelow(SEED_RANGE) if seed is None else seed)
    except ConfigError as exc:  # "sampling: top_p=1.5 must be in (0, 1]"
        raise BadRequest(str(exc)) from exc
    return [replace(params, seed=params.seed + j) for j in range(n)]


def _prompts(value: Any, vocab: Vocabulary, key: str) -> list[list[int]]:
    """One or several prompts, each a list of token ids or a string."""
    if isinstance(value, str):
        return [vocab.encode(value)]
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return [list(value)]
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        return [p for item in value for p in _prompts(item, vocab, key)]
    raise BadRequest(f"{key} must be a string, a list of token ids, or a list of those")


def _stop_ids(where: dict[str, Any], limits: Limits) -> tuple[int, ...]:
    """`stop_token_ids` (vLLM's request field, SGLang's sampling param): token ids that end a generation."""
    value = where.get("stop_token_ids")
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise BadRequest(f"stop_token_ids must be a list of token ids, got {value!r}")
    bad = [t for t in value if not 0 <= t < limits.vocab]
    if bad:
        raise BadRequest(f"stop token id {bad[0]} is out of range [0, {limits.vocab})")
    return tuple(sorted(set(value)))


def _check(prompt: list[int], max_tokens: int, top_k: int, limits: Limits) -> None:
    if not prompt:
        raise BadRequest("a prompt is empty")
    bad = [t for t in prompt if not 0 <= t < limits.vocab]
    if bad:
        raise BadRequest(f"token id {bad[0]} is out of range [0, {limits.vocab})")
    if len(prompt) + max_tokens > limits.max_model_len:
        raise BadRequest(f"prompt of {len(prompt)} tokens + max_tokens={max_tokens} exceeds "
                         f"max_model_len={limits.max_model_len}")
    if top_k > limits.max_logprobs:
        raise BadRequest(f"requested {top_k} logprobs; the server allows at most max_logprobs={limits.max_logprobs}")


def _kv_transfer(body: dict[str, Any], prompts: int) -> list[KVTransfer | None]:
    """`kv_transfer_params` (vLLM's request field for P/D; here {"namespace": NAME, "requests": [index per prompt]}):
    each prompt's entry in a disaggregated server's KV store; None per prompt without the field."""
    value = body.get("kv_transfer_params")
    if value is None:
        return [None] * prompts
    if not isinstance(value, dict):
        raise BadRequest(f"kv_transfer_params must be an object {{\"namespace\": NAME, \"requests\": [index per "
                         f"prompt]}}, got {value!r}")
    namespace, requests = value.get("namespace"), value.get("requests")
    if (not isinstance(namespace, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,128}", namespace)
            or namespace in (".", "..")):
        raise BadRequest(f"kv_transfer_params.namespace={namespace!r} must be a folder name (letters, digits, "
                         f"'_', '.', '-'; not '.' or '..')")
    if (not isinstance(requests, list) or len(requests) != prompts
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in requests)):
        raise BadRequest(f"kv_transfer_params.requests={requests!r} must list one request index >= 0 per prompt "
                         f"({prompts} prompts)")
    return [KVTransfer(namespace, i) for i in requests]


# ---- vLLM / OpenAI /v1/completions -------------------------------------------------------------------------


def parse_completions(body: dict[str, Any], vocab: Vocabulary, limits: Limits) -> list[Completion]:
    """Every completion of a /v1/completions request: prompt i's n completions at i * n .. i * n + n - 1 (the
    order of vLLM's choices)."""
    children = _sampling(body, "seed")
    if "prompt" not in body:
        raise BadRequest("missing 'prompt'")
    prompts = _prompts(body["prompt"], vocab, "prompt")
    max_tokens = _int(body, "max_tokens", DEFAULT_MAX_TOKENS_VLLM) or 0
    top_k = _int(body, "logprobs", None) or 0
    prompt_top_k = _int(body, "prompt_logprobs", None)
    echo = bool(body.get("echo", False))
    wants_prompt = prompt_top_k is not None or (echo and body.get("logprobs") is not None)
    stop = _stop_ids(body, limits)
    out = []
    for p, kv in zip(prompts, _kv_transfer(body, len(prompts))):
        _check(p, max_tokens, max(top_k, prompt_top_k or 0), limits)
        out += [Completion(prompt=p, max_tokens=max_tokens, top_k=top_k,
                           prompt_top_k=max(prompt_top_k or 0, top_k, 1) if wants_prompt else 0,
                           ignore_eos=bool(body.get("ignore_eos", False)), stop_token_ids=stop, kv=kv, sampling=params)
                for params in children]
    return out


def _token_text(token: int, vocab: Vocabulary, as_ids: bool) -> str:
    return f"token_id:{token}" if as_ids else vocab.decode([token])


def _prompt_logprobs_vllm(entries: list[TokenLogprob | None], k: int, vocab: Vocabulary,
                          as_ids: bool) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's prompt_logprobs: per position None or {token id: {logprob, rank, decoded_token}} holding the
    prompt token and the top-k."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        pos = {str(t): {"logprob": lp, "rank": r + 1, "decoded_token": _token_text(t, vocab, as_ids)}
               for r, (t, lp) in enumerate(e.top[:k])}
        pos[str(e.token)] = {"logprob": e.logprob, "rank": e.rank, "decoded_token": _token_text(e.token, vocab, as_ids)}
        out.append(pos)
    return out


def _openai_logprobs(steps: list[TokenLogprob | None], tokens: list[int], k: int, vocab: Vocabulary,
                     as_ids: bool) -> dict[str, Any]:
    """The OpenAI completions logprobs object: tokens, token_logprobs, top_logprobs, text_offset."""
    texts = [_token_text(t, vocab, as_ids) for t in tokens]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(vocab.decode([t]))
    top: list[dict[str, float] | None] = []
    for s in steps:
        top.append(None if s is None else {_token_text(t, vocab, as_ids): lp for t, lp in s.top[:k]}
                   | {_token_text(s.token, vocab, as_ids): s.logprob})
    return {"tokens": texts, "token_logprobs": [None if s is None else s.logprob for s in steps],
            "top_logprobs": top, "text_offset": offsets}


def completions_response(body: dict[str, Any], batch: list[Completion], results: list[CompletionResult],
                         vocab: Vocabulary, model: str) -> dict[str, Any]:
    as_ids = bool(body.get("return_tokens_as_token_ids", False))
    echo = bool(body.get("echo", False))
    choices = []
    for index, (c, r) in enumerate(zip(batch, results)):
        tokens = (c.prompt if echo else []) + r.tokens
        logprobs = None
        if body.get("logprobs") is not None:
            steps: list[TokenLogprob | None] = [*((r.prompt_logprobs or []) if echo else []), *r.logprobs]
            logprobs = _openai_logprobs(steps, tokens, c.top_k, vocab, as_ids)
        prompt_lps = None
        if body.get("prompt_logprobs") is not None and r.prompt_logprobs is not None:
            prompt_lps = _prompt_logprobs_vllm(r.prompt_logprobs, int(body["prompt_logprobs"]), vocab, as_ids)
        choices.append({"index": index, "text": vocab.decode(tokens), "logprobs": logprobs,
                        "finish_reason": r.finish_reason, "stop_reason": None,
                        "prompt_logprobs": prompt_lps, "token_ids": r.tokens})
    prompt_tokens = sum(len(c.prompt) for c in batch)
    completion_tokens = sum(len(r.tokens) for r in results)
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


# ---- SGLang /generate ----------------------------------------------------------------------------------------


def parse_generate(body: dict[str, Any], vocab: Vocabulary, limits: Limits) -> tuple[list[Completion], bool]:
    """The completions of a /generate request (prompt i's n completions together, in prompt order) and whether the
    answer is a list (a batch of prompts, or n > 1)."""
    if "input_ids" in body:
        value, key = body["input_ids"], "input_ids"
    elif "text" in body:
        value, key = body["text"], "text"
    else:
        raise BadRequest("give 'input_ids' or 'text'")
    batched = isinstance(value, list) and bool(value) and isinstance(value[0], (list, str))
    prompts = _prompts(value, vocab, key)
    given = body.get("sampling_params") or {}
    if isinstance(given, dict):
        per_prompt = [given] * len(prompts)
    elif isinstance(given, list) and len(given) == len(prompts) and all(isinstance(g, dict) for g in given):
        per_prompt = given
    else:
        raise BadRequest(f"sampling_params must be an object, or a list of one object per prompt ({len(prompts)})")
    logprob = bool(body.get("return_logprob", False))
    top_k = (_int(body, "top_logprobs_num", 0) or 0) if logprob else 0
    start = _int(body, "logprob_start_len", -1, minimum=-1)
    out = []
    for p, params in zip(prompts, per_prompt):
        max_tokens = _int(params, "max_new_tokens", DEFAULT_MAX_TOKENS_SGLANG) or 0
        stop = _stop_ids(params, limits)
        children = _sampling(params, "sampling_seed")
        _check(p, max_tokens, top_k, limits)
        out += [Completion(prompt=p, max_tokens=max_tokens, top_k=top_k if logprob else 0,
                           prompt_top_k=max(top_k, 1) if logprob and start is not None and start >= 0 else 0,
                           ignore_eos=bool(params.get("ignore_eos", False)), stop_token_ids=stop, sampling=child)
                for child in children]
    return out, batched or len(out) > 1


def _triple(lp: float | None, token: int, vocab: Vocabulary, text: bool) -> list[Any]:
    return [lp, token, vocab.decode([token]) if text else None]


def _sglang_one(body: dict[str, Any], c: Completion, r: CompletionResult, vocab: Vocabulary) -> dict[str, Any]:
    text = bool(body.get("return_text_in_logprobs", False))
    finish: dict[str, Any] = ({"type": "stop", "matched": r.tokens[-1]} if r.finish_reason == "stop"
                              else {"type": "length", "length": len(r.tokens)})
    meta: dict[str, Any] = {"id": uuid.uuid4().hex, "prompt_tokens": len(c.prompt), "completion_tokens": len(r.tokens),
                            "finish_reason": finish, "spec_verify_ct": r.spec_steps}
    if body.get("return_logprob"):
        start = int(body.get("logprob_start_len", -1))
        entries = (r.prompt_logprobs or [])[start:] if start >= 0 else []
        prompt_ids = c.prompt[start:] if start >= 0 else []
        meta["input_token_logprobs"] = [_triple(None if e is None else e.logprob, t, vocab, text)
                                        for e, t in zip(entries, prompt_ids)]
        meta["output_token_logprobs"] = [_triple(s.logprob, s.token, vocab, text) for s in r.logprobs]
        if c.top_k > 0:
            meta["input_top_logprobs"] = [None if e is None
                                          else [_triple(lp, t, vocab, text) for t, lp in e.top[:c.top_k]]
                                          for e in entries]
            meta["output_top_logprobs"] = [[_triple(lp, t, vocab, text) for t, lp in s.top[:c.top_k]]
                                           for s in r.logprobs]
    return {"text": vocab.decode(r.tokens), "output_ids": r.tokens, "meta_info": meta}


def generate_response(body: dict[str, Any], batch: list[Completion], results: list[CompletionResult],
                      vocab: Vocabulary, batched: bool) -> dict[str, Any] | list[dict[str, Any]]:
    out = [_sglang_one(body, c, r, vocab) for c, r in zip(batch, results)]
    return out if batched else out[0]
