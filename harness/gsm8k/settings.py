"""A suite's `gsm8k:` settings, parsed once into a frozen, self-validating spec."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from harness.core.errors import ConfigError
from harness.gsm8k.records import FILTERS, STRICT
from harness.gsm8k.stats import DEFAULT_ALPHA, DEFAULT_BETA, DEFAULT_DETECT_DROP
from harness.specs.loader import build, did_you_mean, expect_int, expect_mapping
from harness.specs.sampling import SamplingParams


@dataclass(frozen=True)
class GSM8KSettings:
    """How one suite runs and gates GSM8K. Scores, drops and agreements are fractions in 0..1.

    task: lm-eval variant (gsm8k, gsm8k_cot, ...); limit: first N test questions (None: all 1319);
    num_fewshot: None keeps the variant's count; chat_template: render prompts with the model's
    chat template (instruct models); filter: the lm-eval filter whose score is gated and compared;
    alpha, beta, sigma: the baseline gate (sigma None: from the measured score); detect_drop: the
    drop the gate must be able to detect, else WARN; min_answer_agreement: the paired check fails
    below this fraction of equal extracted answers; min_generation_agreement: ... or below this fraction
    of identical greedy generations (vLLM's MTP rule: 80%; small models' answers often all fail to
    parse, so equal answers alone can hide a broken run); sampling: SamplingParams of a sampled run (per-question
    seeds), None for greedy.
    """

    task: str = "gsm8k"
    limit: int | None = None
    num_fewshot: int | None = None
    chat_template: bool = False
    fewshot_as_multiturn: bool = False
    max_new_tokens: int = 256
    batch_size: int = 8
    filter: str = STRICT
    alpha: float = DEFAULT_ALPHA
    beta: float = DEFAULT_BETA
    sigma: float | None = None
    detect_drop: float = DEFAULT_DETECT_DROP
    min_answer_agreement: float = 0.9
    min_generation_agreement: float = 0.8
    # sampled GSM8K (None: greedy): every question's request samples with these settings from its own generator,
    # seeded by sampling.request_seed(question position), so the reference and the parallel run draw alike
    sampling: SamplingParams | None = None

    def __post_init__(self) -> None:
        where = "gsm8k settings"
        if self.limit is not None:
            expect_int(where, "limit", self.limit, minimum=1)
        if self.num_fewshot is not None:
            expect_int(where, "num_fewshot", self.num_fewshot, minimum=0)
        expect_int(where, "max_new_tokens", self.max_new_tokens, minimum=1)
        expect_int(where, "batch_size", self.batch_size, minimum=1)
        if self.filter not in FILTERS:
            raise ConfigError(f"{where}: filter={self.filter!r} is not one of {', '.join(FILTERS)}"
                              f"{did_you_mean(self.filter, FILTERS)}")
        for name in ("alpha", "beta", "detect_drop", "min_answer_agreement", "min_generation_agreement"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
                raise ConfigError(f"{where}: {name}={value!r} must be a fraction in (0, 1]")
        if self.alpha >= 1.0 or self.beta >= 1.0:
            raise ConfigError(f"{where}: alpha={self.alpha} and beta={self.beta} must be < 1")
        if self.sigma is not None and (isinstance(self.sigma, bool) or not isinstance(self.sigma, (int, float))
                                       or not 0.0 < self.sigma <= 0.5):
            raise ConfigError(f"{where}: sigma={self.sigma!r} must be in (0, 0.5] (a Bernoulli sigma on 0..1)")

    def to_dict(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self.__dataclass_fields__}
        out["sampling"] = self.sampling.to_dict() if self.sampling is not None else None
        return out

    def describe_sampling(self) -> str:
        """'greedy' or 'sampled (temperature 0.7, ..., per-question seeds)'."""
        if self.sampling is None:
            return "greedy"
        text = self.sampling.describe().split(", seed ")[0]
        return f"sampled ({text}, seed {self.sampling.seed}, per-question seeds)"


def gsm8k_settings(data: Mapping[str, Any] | None, where: str = "gsm8k settings") -> GSM8KSettings:
    """Parse a suite's `gsm8k:` mapping (unknown keys rejected with 'did you mean'; `sampling:` a mapping of
    SamplingParams fields, e.g. {temperature: 0.7, seed: 3})."""
    data = dict(data or {})
    raw = data.pop("sampling", None)
    try:
        sampling = SamplingParams.from_dict(expect_mapping(f"{where}: sampling", raw)) if raw is not None else None
    except TypeError as exc:  # a value of the wrong type (a string for a number)
        raise ConfigError(f"{where}: sampling {dict(raw)!r}: {exc}; give numbers (e.g. temperature: 0.7)") from None
    return build(GSM8KSettings, where, data, sampling=sampling)
