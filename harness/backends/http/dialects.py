"""Request dialects of external engines: how to ask a server for teacher-forced top-k logprobs of a
token sequence and for a greedy generation with per-step top-k, and how to read the answers.

Logprobs are aligned by token id, never by list position (servers may skip or add entries, e.g. the
prompt token beside the top-k); a top-k keyed by token strings is refused, since different ids that
decode to the same string collapse into one entry.
  vllm   /v1/completions, token-id prompt, prompt_logprobs + logprobs, return_tokens_as_token_ids
  sglang /generate, input_ids, return_logprob, logprob_start_len=0, top_logprobs_num
  openai /v1/completions with echo + logprobs (token ids required in the answer)

A sampled workload's requests (harness/specs/sampling.py) carry its settings in the engine's own names (vLLM's at the
top level, SGLang's in sampling_params): temperature, top_k (-1: off), top_p, min_p, repetition_penalty,
presence_penalty, frequency_penalty, and each request's seed (vLLM `seed`, SGLang `sampling_seed`). `draw` asks for n
draws of one next token: vLLM `n` (its children seeded seed + j), SGLang the prompt n times in one batch, copy j
seeded seed + j.
"""

from __future__ import annotations

import math
import re
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Sequence

import httpx
import torch

from harness.core.errors import RunError
from harness.specs.sampling import SamplingParams

TOKEN_ID_KEY = re.compile(r"^token_id:(-?\d+)$")
# vLLM v1's speculative-decoding Prometheus counters (vllm/v1/spec_decode/metrics.py): verify steps
# ("drafts"), proposed tokens and accepted tokens, one sample per label set (engine, model)
SPEC_COUNTER = re.compile(r"^vllm:spec_decode_num_(drafts|draft_tokens|accepted_tokens)_total(?:\{[^}]*\})?\s+(\S+)")
# and the accepted tokens per draft position (0-based label `position`), summed over the other labels
SPEC_POSITION_COUNTER = re.compile(
    r'^vllm:spec_decode_num_accepted_tokens_per_pos(?:_total)?\{[^}]*\bposition="(\d+)"[^}]*\}\s+(\S+)')
Post = Callable[[str, dict[str, Any]], Any]


# a non-finite logprob as the server spelled it: {"row", "token", "value": "null" / "NaN" / "Infinity" / ...}
Nonfinite = dict[str, Any]


@dataclass(frozen=True)
class Scored:
    """Teacher-forced top-k of one sequence: ids [T, k] int64, logprobs [T, k] float32 (row t predicts t+1);
    `nonfinite`: the logprobs the server answered as null (stored as NaN), NaN or infinite, as it spelled them."""

    ids: torch.Tensor
    logprobs: torch.Tensor
    nonfinite: tuple[Nonfinite, ...] = ()


@dataclass(frozen=True)
class Generation:
    """Greedy generation: tokens [N] int64, per-step top-k ids [N, k] and logprobs [N, k]; with a
    speculator, the verify steps the engine reports for this request (SGLang's meta_info.spec_verify_ct)."""

    tokens: torch.Tensor
    ids: torch.Tensor
    logprobs: torch.Tensor
    verify_steps: int | None = None
    nonfinite: tuple[Nonfinite, ...] = ()


def logprob(value: Any) -> float:
    """A logprob as the server answered it: a number (NaN and infinities kept), null -> NaN, a numeric
    string ("NaN", "-Infinity") -> its float; anything else is a RunError naming it."""
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise RunError(f"the server answered a logprob {value!r}, not a number")
    try:
        return float(value)
    except ValueError as exc:
        raise RunError(f"the server answered a logprob {value!r}, not a number") from exc


def spelling(value: Any) -> str:
    """How the server wrote a logprob in its JSON answer: 'null', 'NaN', 'Infinity', '-Infinity', '"nan"'."""
    if value is None:
        return "null"
    if isinstance(value, str):
        return repr(value)
    number = float(value)
    return "NaN" if math.isnan(number) else ("Infinity" if number > 0 else "-Infinity")


def parse_row(pairs: Sequence[tuple[int, Any]], row: int) -> tuple[dict[int, float], list[Nonfinite]]:
    """(token id, logprob as answered) pairs of one position -> ({id: logprob}, the non-finite ones as
    spelled, e.g. [{"row": 3, "token": 17, "value": "null"}])."""
    values = {token: logprob(value) for token, value in pairs}
    bad = [{"row": row, "token": token, "value": spelling(value)} for token, value in pairs
           if not math.isfinite(values[token])]
    return values, bad


def _rank(item: tuple[int, float]) -> tuple[bool, float, int]:
    """Sort key of a top-k entry: best first, ties by id; a non-finite one (NaN, an infinity) first, so k
    never cuts it off and the checks see it."""
    token, lp = item
    finite = math.isfinite(lp)
    return (finite, -lp if finite else 0.0, token)


def topk_rows(rows: Sequence[dict[int, float]], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of {token id: logprob} -> ([R, k] ids, [R, k] logprobs), best first (ties by id, non-finite first);
    a row with fewer than k entries is padded with id -1 and logprob -inf."""
    ids = torch.full((len(rows), k), -1, dtype=torch.long)
    lps = torch.full((len(rows), k), -math.inf, dtype=torch.float32)
    for r, row in enumerate(rows):
        best = sorted(row.items(), key=_rank)[:k]
        for j, (token, lp) in enumerate(best):
            ids[r, j] = token
            lps[r, j] = lp
    return ids, lps


def parse_spec_counters(metrics_text: str) -> dict[str, float] | None:
    """Prometheus text -> {"drafts", "draft_tokens", "accepted_tokens"} summed over label sets; None
    when the server exports no spec-decode counters."""
    totals: dict[str, float] = {}
    for line in metrics_text.splitlines():
        match = SPEC_COUNTER.match(line)
        if match:
            totals[match.group(1)] = totals.get(match.group(1), 0.0) + float(match.group(2))
    return totals if "drafts" in totals else None


def parse_position_counters(metrics_text: str) -> dict[int, float]:
    """Prometheus text -> {draft position (0-based): accepted tokens} from vLLM's
    vllm:spec_decode_num_accepted_tokens_per_pos counters summed over label sets; {} when it exports none."""
    totals: dict[int, float] = {}
    for line in metrics_text.splitlines():
        match = SPEC_POSITION_COUNTER.match(line)
        if match:
            totals[int(match.group(1))] = totals.get(int(match.group(1)), 0.0) + float(match.group(2))
    return totals


def token_id(key: str) -> int:
    """'token_id:123' -> 123; anything else is refused (a top-k keyed by text collapses duplicates)."""
    match = TOKEN_ID_KEY.match(key)
    if match is None:
        raise RunError(f"the server returned token {key!r} as text, not as 'token_id:N': a top-k keyed by "
                       f"token strings collapses duplicates and cannot be aligned by id (the server must "
                       f"support return_tokens_as_token_ids)")
    return int(match.group(1))


def sampling_fields(params: SamplingParams) -> dict[str, Any]:
    """A sampled request's settings under the names vLLM and SGLang share (the seed goes under each one's key)."""
    return {"temperature": params.temperature, "top_k": params.top_k or -1, "top_p": params.top_p,
            "min_p": params.min_p, "repetition_penalty": params.repetition_penalty,
            "presence_penalty": params.presence_penalty, "frequency_penalty": params.frequency_penalty}


def post_json(client: httpx.Client) -> Post:
    """POST a JSON body, returning the JSON answer; a non-200 answer is a RunError naming status and body."""
    def post(path: str, body: dict[str, Any]) -> Any:
        try:
            response = client.post(path, json=body)
        except httpx.TimeoutException as exc:
            raise RunError(f"POST {path}: no answer within {client.timeout.read} s") from exc
        except httpx.TransportError as exc:
            raise RunError(f"POST {path}: {exc}") from exc
        if response.status_code != 200:
            raise RunError(f"POST {path}: HTTP {response.status_code}: {response.text[:500]}")
        try:
            return response.json()
        except ValueError as exc:  # not JSON, or not UTF-8
            raise RunError(f"POST {path}: HTTP 200 with a body that is not JSON: {response.text[:200]!r}") from exc
    return post


@contextmanager
def answer_shape(dialect: str, what: str) -> Iterator[None]:
    """Reading a server's answer: one that lacks a field or holds a value of another type (a list where an object
    belongs, a string for a token id, a number out of range) is the RunError of a bad answer (the cell's ERROR),
    naming what was read, never a KeyError or TypeError from deep inside the parser."""
    try:
        yield
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, OverflowError, RuntimeError) as exc:
        raise RunError(f"the server's {what} are not a {dialect or 'known'} dialect's answer "
                       f"({type(exc).__name__}: {str(exc)[:200]})") from exc


class Dialect:
    """Asks for scores and generations of several sequences in one request (`together`) or one by one. `seed`: the
    run seed, sent with each greedy request as its sampling seed where the dialect has one (it decides nothing
    there); a sampled request carries its own seed (generate's `seeds`, draw's `seed`) unless `seeded` is false (an
    engine whose template says it cannot take per-request seeds: its sampled requests go unseeded)."""

    name = ""

    def __init__(self, post: Post, model: str, seed: int | None = None, seeded: bool = True) -> None:
        self.post = post
        self.model = model
        self.seed = seed
        self.seeded = seeded

    def score(self, sequences: Sequence[Sequence[int]], k: int, together: bool) -> list[Scored]:
        groups = [list(sequences)] if together else [[s] for s in sequences]
        with answer_shape(self.name, "scores"):
            return [s for g in groups for s in self._score(g, k)]

    def generate(self, prompts: Sequence[Sequence[int]], n: int, k: int, together: bool,
                 sampling: SamplingParams | None = None, seeds: Sequence[int] = ()) -> list[Generation]:
        """Greedy generations, or with `sampling` sampled ones, prompt i seeded seeds[i] (one request each: a request
        has one seed)."""
        with answer_shape(self.name, "generations"):
            if sampling is not None:
                if len(seeds) != len(prompts):
                    raise RunError(f"a sampled generation needs one seed per prompt ({len(prompts)}, got {len(seeds)})")
                return [g for p, seed in zip(prompts, seeds)
                        for g in self._generate([p], n, k, None, sampling, seed if self.seeded else None)]
            groups = [list(prompts)] if together else [[p] for p in prompts]
            return [g for group in groups for g in self._generate(group, n, k)]

    def draw(self, sequence: Sequence[int], sampling: SamplingParams, seed: int, n: int) -> list[int]:
        """n draws of the token after `sequence` under `sampling` (one request: draw j seeded seed + j)."""
        with answer_shape(self.name, "draws"):
            return self._draw(sequence, sampling, seed if self.seeded else None, n)

    def _draw(self, sequence: Sequence[int], sampling: SamplingParams, seed: int | None, n: int) -> list[int]:
        raise NotImplementedError

    def complete(self, prompts: Sequence[Sequence[int]], n: int, stop: Sequence[int]) -> list[list[int]]:
        """Greedy completions of all `prompts` in one request, each ending at EOS or a `stop` token id
        (kept) or after `n` tokens: the new token ids (GSM8K's generate_until over HTTP)."""
        with answer_shape(self.name, "completions"):
            return [g.tokens.tolist() for g in self._generate(list(prompts), n, 1, tuple(stop))]

    def _score(self, sequences: list[Sequence[int]], k: int) -> list[Scored]:
        raise NotImplementedError

    def _generate(self, prompts: list[Sequence[int]], n: int, k: int, stop: tuple[int, ...] | None = None,
                  sampling: SamplingParams | None = None, seed: int | None = None) -> list[Generation]:
        """`stop` None: exactly `n` tokens (EOS ignored); else end at EOS or one of `stop`. `sampling`: sampled, from
        `seed`."""
        raise NotImplementedError


Step = tuple[int, dict[int, float], list[Nonfinite]]  # (token id, {id: logprob}, its non-finite logprobs)


def _generation(steps: list[Step], k: int) -> Generation:
    ids, lps = topk_rows([row for _, row, _ in steps], k)
    return Generation(torch.tensor([t for t, _, _ in steps], dtype=torch.long), ids, lps,
                      nonfinite=tuple(b for _, _, bad in steps for b in bad))


def _choices(answer: dict[str, Any], n: int) -> list[dict[str, Any]]:
    choices = sorted(answer.get("choices") or [], key=lambda c: int(c.get("index", 0)))
    if len(choices) != n:
        raise RunError(f"/v1/completions answered {len(choices)} choices for {n} completions")
    return choices


def _openai_steps(logprobs: dict[str, Any] | None, first_row: int = 0) -> list[Step]:
    """(token id, {id: logprob}, its non-finite logprobs) per token of an OpenAI completions logprobs
    object; a token without top logprobs (null) has an empty row. Rows are numbered from `first_row`."""
    if not logprobs:
        raise RunError("/v1/completions answered without logprobs")
    tops = logprobs.get("top_logprobs") or []
    steps: list[Step] = []
    for i, (t, top) in enumerate(zip(logprobs["tokens"], tops)):
        row, bad = parse_row([(token_id(key), v) for key, v in (top or {}).items()], first_row + i)
        steps.append((token_id(t), row, bad))
    return steps


def _shift(bad: list[Nonfinite], row: int) -> list[Nonfinite]:
    return [{**b, "row": row} for b in bad]


class VllmDialect(Dialect):
    name = "vllm"

    def _body(self, prompts: list[Sequence[int]], n: int, k: int, stop: tuple[int, ...] | None = None,
              sampling: SamplingParams | None = None, seed: int | None = None) -> dict[str, Any]:
        ends = {"ignore_eos": True} if stop is None else {"ignore_eos": False, "stop_token_ids": list(stop)}
        if sampling is None:
            how: dict[str, Any] = {"temperature": 0, **({"seed": self.seed} if self.seed is not None else {})}
        else:
            how = {**sampling_fields(sampling), **({"seed": seed} if seed is not None else {})}
        return {"model": self.model, "prompt": [list(p) for p in prompts], "max_tokens": n, "logprobs": k,
                "return_tokens_as_token_ids": True, **how, **ends}

    def _score(self, sequences: list[Sequence[int]], k: int) -> list[Scored]:
        answer = self.post("/v1/completions", {**self._body(sequences, 1, k), "prompt_logprobs": k})
        out = []
        for seq, choice in zip(sequences, _choices(answer, len(sequences))):
            entries = choice.get("prompt_logprobs")
            if not entries or len(entries) != len(seq):
                raise RunError(f"prompt_logprobs has {len(entries or [])} entries for a prompt of {len(seq)} tokens")
            parsed = [parse_row([(int(t), v.get("logprob") if isinstance(v, dict) else v)
                                 for t, v in (e or {}).items()], row) for row, e in enumerate(entries[1:])]
            _, last, last_bad = _openai_steps(choice.get("logprobs"))[0]
            bad = [b for _, row_bad in parsed for b in row_bad] + _shift(last_bad, len(parsed))
            out.append(Scored(*topk_rows([*(row for row, _ in parsed), last], k), nonfinite=tuple(bad)))
        return out

    def _generate(self, prompts: list[Sequence[int]], n: int, k: int, stop: tuple[int, ...] | None = None,
                  sampling: SamplingParams | None = None, seed: int | None = None) -> list[Generation]:
        answer = self.post("/v1/completions", self._body(prompts, n, k, stop, sampling, seed))
        return [_generation(_openai_steps(c.get("logprobs")), k) for c in _choices(answer, len(prompts))]

    def _draw(self, sequence: Sequence[int], sampling: SamplingParams, seed: int | None, n: int) -> list[int]:
        answer = self.post("/v1/completions", {**self._body([sequence], 1, 1, None, sampling, seed), "n": n})
        return [_openai_steps(c.get("logprobs"))[0][0] for c in _choices(answer, n)]


class OpenAIDialect(VllmDialect):
    """Plain OpenAI completions: prompt scores from `echo` + `logprobs` (no prompt_logprobs)."""

    name = "openai"

    def _score(self, sequences: list[Sequence[int]], k: int) -> list[Scored]:
        answer = self.post("/v1/completions", {**self._body(sequences, 1, k), "echo": True})
        out = []
        for seq, choice in zip(sequences, _choices(answer, len(sequences))):
            steps = _openai_steps(choice.get("logprobs"), first_row=-1)  # row r of the scores: echo token r + 1
            if len(steps) != len(seq) + 1:
                raise RunError(f"echo answered {len(steps)} tokens for a prompt of {len(seq)} tokens + 1")
            out.append(Scored(*topk_rows([top for _, top, _ in steps[1:]], k),
                              nonfinite=tuple(b for _, _, bad in steps[1:] for b in bad)))
        return out


def _sglang_row(entries: list[list[Any]] | None, row: int) -> tuple[dict[int, float], list[Nonfinite]]:
    """SGLang's [logprob, token id, text] triples of one position (a null logprob kept, as NaN)."""
    return parse_row([(int(token), lp) for lp, token, *_ in (entries or [])], row)


class SglangDialect(Dialect):
    name = "sglang"

    def _body(self, prompts: list[Sequence[int]], n: int, k: int, stop: tuple[int, ...] | None = None,
              sampling: SamplingParams | None = None, seed: int | None = None) -> dict[str, Any]:
        ends = {"ignore_eos": True} if stop is None else {"ignore_eos": False, "stop_token_ids": list(stop)}
        how = {"temperature": 0} if sampling is None else {
            **sampling_fields(sampling), **({"sampling_seed": seed} if seed is not None else {})}
        return {"input_ids": [list(p) for p in prompts], "return_logprob": True, "top_logprobs_num": k,
                "sampling_params": {"max_new_tokens": n, **how, **ends}}

    def _answers(self, body: dict[str, Any], n: int) -> list[dict[str, Any]]:
        answer = self.post("/generate", body)
        answers = answer if isinstance(answer, list) else [answer]
        if len(answers) != n:
            raise RunError(f"/generate answered {len(answers)} results for {n} prompts")
        return answers

    def _score(self, sequences: list[Sequence[int]], k: int) -> list[Scored]:
        body = {**self._body(sequences, 1, k), "logprob_start_len": 0}
        out = []
        for seq, answer in zip(sequences, self._answers(body, len(sequences))):
            meta = answer["meta_info"]
            tops = meta.get("input_top_logprobs") or []
            if len(tops) != len(seq):
                raise RunError(f"input_top_logprobs has {len(tops)} entries for a prompt of {len(seq)} tokens")
            rows = [_sglang_row(t, r) for r, t in enumerate(tops[1:])]
            rows.append(_sglang_row(meta["output_top_logprobs"][0], len(rows)))
            out.append(Scored(*topk_rows([row for row, _ in rows], k),
                              nonfinite=tuple(b for _, bad in rows for b in bad)))
        return out

    def _draw(self, sequence: Sequence[int], sampling: SamplingParams, seed: int | None, n: int) -> list[int]:
        body = {"input_ids": [list(sequence)] * n, "return_logprob": True, "top_logprobs_num": 0,
                "sampling_params": [{"max_new_tokens": 1, "ignore_eos": True, **sampling_fields(sampling),
                                     **({"sampling_seed": seed + j} if seed is not None else {})} for j in range(n)]}
        return [int(answer["meta_info"]["output_token_logprobs"][0][1]) for answer in self._answers(body, n)]

    def _generate(self, prompts: list[Sequence[int]], n: int, k: int, stop: tuple[int, ...] | None = None,
                  sampling: SamplingParams | None = None, seed: int | None = None) -> list[Generation]:
        out = []
        for answer in self._answers(self._body(prompts, n, k, stop, sampling, seed), len(prompts)):
            meta = answer["meta_info"]
            tokens = [int(t) for _, t, *_ in meta["output_token_logprobs"]]
            rows = [_sglang_row(top, r) for r, top in enumerate(meta["output_top_logprobs"])]
            generation = _generation([(t, row, bad) for t, (row, bad) in zip(tokens, rows)], k)
            steps = int(meta.get("spec_verify_ct") or 0)  # 0 / absent: no speculative decoding
            out.append(replace(generation, verify_steps=steps) if steps > 0 else generation)
        return out


# each dialect by its class's name: the names a template's `dialect` takes (harness.specs.engine.DIALECT_NAMES,
# validated when a template loads; tests/test_http_dialects.py asserts the two lists are the same)
DIALECTS: dict[str, type[Dialect]] = {d.name: d for d in (VllmDialect, SglangDialect, OpenAIDialect)}
