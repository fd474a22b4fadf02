"""The lm-eval model that drives the harness's engine: batched greedy (or seeded sampled) generation, stop strings,
chat.

Every rank of the engine's process group runs the same requests in lockstep (the engine is
tensor/context parallel, not data parallel), so this LM tells lm-eval rank 0 / world size 1
on every rank and lm-eval never shards requests. Only rank 0 should write results.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence

from lm_eval.api.instance import Instance
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.defaults import DEFAULT_MAX_GEN_TOKS

from harness.core.errors import ConfigError, RunError
from harness.formats.tokenizer import Tokenizer
from harness.gsm8k.data import resolve_source
from harness.gsm8k.records import GSM8KResult
from harness.gsm8k.settings import GSM8KSettings
from harness.gsm8k.tasks import evaluate_with
from harness.specs.sampling import SamplingParams


class Generator(Protocol):
    """What the LM needs from an engine: batched greedy generation over token ids."""

    tokenizer: Tokenizer
    rank: int
    world_size: int

    def generate(self, prompts: list[list[int]], max_new_tokens: int, stop_token_ids: set[int],
                 stop_strings: Sequence[str] = (), max_batch: int | None = None) -> list[list[int]]:
        """Greedy continuation of each prompt; returns only the new tokens (may end with a stop token).
        At most `max_batch` sequences run at once (continuous batching refills finished slots); a
        sequence may end early once its text contains one of `stop_strings` (the text is cut there).
        A generator that samples (sampled GSM8K: `samples` True) also takes `seeds=`, one per prompt."""
        ...


@dataclass(frozen=True)
class _Request:
    """One generate_until request, tokenized: where it came from and how to stop."""

    position: int
    prompt_ids: list[int]
    until: tuple[str, ...]
    max_new_tokens: int


def _until(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ConfigError(f"gen_kwargs['until'] must be a string or a list of strings, got {value!r}")


def cut_at_stop(text: str, until: Sequence[str]) -> str:
    """`text` up to (not including) the earliest occurrence of any stop string."""
    cut = len(text)
    for stop in until:
        if stop:
            at = text.find(stop)
            if at != -1:
                cut = min(cut, at)
    return text[:cut]


def cut_at_stop_token(ids: list[int], stop_token_ids: set[int]) -> list[int]:
    """`ids` up to (not including) the first stop token."""
    for i, tok in enumerate(ids):
        if tok in stop_token_ids:
            return ids[:i]
    return ids


@register_model("harness")
class HarnessLM(LM):
    """lm-eval model over a `Generator`. Greedy only; loglikelihood is not supported.

    `max_gen_toks` caps every request's max_gen_toks (None: the request's own, lm-eval's default
    256 when absent); `max_length` (when set) left-truncates prompts so prompt + generation fit.
    """

    def __init__(self, generator: Generator, batch_size: int = 8, max_gen_toks: int | None = None,
                 max_length: int | None = None, name: str = "harness", sampling: SamplingParams | None = None) -> None:
        super().__init__()
        if sampling is not None and not getattr(generator, "samples", False):
            raise ConfigError(f"GSM8K sampling ({sampling.describe()}) needs an engine whose GSM8K generator samples "
                              f"(the embedded engine); {type(generator).__name__} generates greedily: drop gsm8k "
                              f"sampling for this engine")
        self.sampling = sampling
        if batch_size < 1:
            raise ConfigError(f"batch_size={batch_size} must be >= 1")
        if max_gen_toks is not None and max_gen_toks < 1:
            raise ConfigError(f"max_gen_toks={max_gen_toks} must be >= 1")
        self.generator = generator
        self.batch_size = batch_size
        self.max_gen_toks = max_gen_toks
        self.max_length = max_length
        self.name = name
        self.generated_tokens = 0  # new tokens produced (before cutting at stop strings), for throughput

    # rank/world_size stay LM's defaults (0 / 1): lm-eval must not shard requests across engine ranks.

    @property
    def tokenizer_name(self) -> str:
        return self.name

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.name if chat_template else ""

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not add_generation_prompt:
            raise NotImplementedError("the harness LM only renders chat prompts that end with a generation "
                                      "prompt (add_generation_prompt=True)")
        return self.generator.tokenizer.apply_chat_template(chat_history)

    def loglikelihood(self, requests: list[Instance]) -> list[tuple[float, bool]]:
        raise NotImplementedError("the harness LM supports generate_until tasks only (GSM8K); loglikelihood "
                                  "needs per-token log-probabilities, which the Generator protocol does not expose")

    def loglikelihood_rolling(self, requests: list[Instance]) -> list[float]:
        raise NotImplementedError("the harness LM supports generate_until tasks only (GSM8K); "
                                  "loglikelihood_rolling is not available")

    def generate_until(self, requests: list[Instance]) -> list[str]:
        """Greedy continuations, batched by length (longest first), returned in request order."""
        prepared = [self._prepare(i, req) for i, req in enumerate(requests)]
        outputs: list[str] = [""] * len(prepared)
        for batch in self._batches(prepared):
            for req, text in zip(batch, self._generate_batch(batch), strict=True):
                outputs[req.position] = text
        return outputs

    def _prepare(self, position: int, request: Instance) -> _Request:
        context, gen_kwargs = request.args
        kwargs = dict(gen_kwargs or {})
        if kwargs.get("do_sample", False):
            raise ConfigError(f"request {position} asks for sampling (do_sample=True); the harness LM is greedy")
        max_new = int(kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
        if self.max_gen_toks is not None:
            max_new = min(max_new, self.max_gen_toks)
        ids = self.generator.tokenizer.encode(context)
        if self.max_length is not None:
            keep = self.max_length - max_new
            if keep < 1:
                raise ConfigError(f"max_length={self.max_length} leaves no room for a prompt with "
                                  f"max_gen_toks={max_new}")
            ids = ids[-keep:]
        return _Request(position=position, prompt_ids=ids, until=_until(kwargs.get("until")),
                        max_new_tokens=max_new)

    def _batches(self, prepared: list[_Request]) -> list[list[_Request]]:
        """Group requests that stop alike, longest prompt first; each group goes to the generator whole
        and runs `batch_size` at a time with continuous refill."""
        groups: dict[tuple[tuple[str, ...], int], list[_Request]] = {}
        for req in prepared:
            groups.setdefault((req.until, req.max_new_tokens), []).append(req)
        batches = []
        for group in groups.values():
            group.sort(key=lambda r: (-len(r.prompt_ids), r.position))
            batches.append(group)
        return batches

    def stop_token_ids(self, until: Sequence[str]) -> set[int]:
        """EOS plus every stop string that is exactly one token (safe to stop on at the token level).

        A special token (e.g. <|im_end|>) decodes to '' because decode drops specials: it still counts,
        else the text after it would survive (the text cut cannot see a token that decodes to nothing).
        """
        tokenizer = self.generator.tokenizer
        ids = {tokenizer.eos_id} if tokenizer.eos_id is not None else set()
        for stop in until:
            encoded = tokenizer.encode(stop) if stop else []
            if len(encoded) == 1 and tokenizer.decode(encoded) in ("", stop):
                ids.add(encoded[0])
        return ids

    def _generate_batch(self, batch: list[_Request]) -> list[str]:
        first = batch[0]
        stops = self.stop_token_ids(first.until)
        seeds = {"seeds": [self.sampling.request_seed(r.position) for r in batch]} if self.sampling else {}
        new = self.generator.generate([r.prompt_ids for r in batch], first.max_new_tokens, stops,  # type: ignore[call-arg]
                                      stop_strings=first.until, max_batch=self.batch_size, **seeds)
        if len(new) != len(batch):
            raise RunError(f"generator returned {len(new)} sequences for {len(batch)} prompts")
        texts = []
        for ids in new:
            self.generated_tokens += len(ids)
            texts.append(cut_at_stop(self.generator.tokenizer.decode(cut_at_stop_token(list(ids), stops)),
                                     first.until))
        return texts


def evaluate_generator(generator: Generator, settings: GSM8KSettings, data_path: str | Path | None,
                       max_length: int) -> GSM8KResult:
    """GSM8K (the suite's settings) through any Generator (the engine in engine_eval.py, a server in
    backends/http/gsm8k.py), per-question records included."""
    lm = HarnessLM(generator, batch_size=settings.batch_size, max_gen_toks=settings.max_new_tokens,
                   max_length=max_length, sampling=settings.sampling)
    return evaluate_with(lm, settings.task, resolve_source(data_path), limit=settings.limit,
                         num_fewshot=settings.num_fewshot, apply_chat_template=settings.chat_template,
                         fewshot_as_multiturn=settings.fewshot_as_multiturn)
