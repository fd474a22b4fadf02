"""The dialect-neutral request and result of one completion (what both HTTP dialects translate to)."""

from __future__ import annotations

from dataclasses import dataclass, field

from harness.core.errors import ConfigError
from harness.specs.sampling import SamplingParams

TopK = list[tuple[int, float]]  # (token id, logprob), best first


@dataclass(frozen=True)
class Completion:
    """Completion of `prompt` (token ids), greedy or, with `sampling`, sampled by the engine's sampler from a
    generator seeded by `sampling.seed` (this completion's own seed). `prompt_top_k` > 0 asks for teacher-forced
    logprobs of every prompt position; `top_k` > 0 for the top-k of every generated step."""

    prompt: list[int]
    max_tokens: int
    top_k: int = 0
    prompt_top_k: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()  # generation also ends at these (kept, as vLLM's stop_token_ids)
    kv: KVTransfer | None = None  # a disaggregated server's KV store entry of this prompt (kv_transfer_params)
    sampling: SamplingParams | None = None  # None: greedy


@dataclass(frozen=True)
class KVTransfer:
    """Where a prompt's KV goes (a prefill server) or comes from (a decode server) in the store both servers share
    (`harness serve --pd-store ROOT`): entry `request` of folder `namespace` under ROOT (one folder per run)."""

    namespace: str
    request: int


@dataclass(frozen=True)
class TokenLogprob:
    """The logprob and 1-based rank of the token actually at a position, and that position's top-k."""

    token: int
    logprob: float
    rank: int
    top: TopK


@dataclass(frozen=True)
class CompletionResult:
    """`prompt_logprobs[t]` scores prompt token t given tokens < t (None for t = 0)."""

    tokens: list[int]
    logprobs: list[TokenLogprob]
    prompt_logprobs: list[TokenLogprob | None] | None
    finish_reason: str  # "length" or "stop"
    spec_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    accepted_per_step: list[int] = field(default_factory=list)


PD_SERVE_ROLES: tuple[str, ...] = ("prefill", "decode")


def check_pd_role(role: str, store: str, has_prefill: bool, topology: str) -> None:
    """A serve configuration's P/D options agree with its topology: one clear error otherwise."""
    if has_prefill and role not in PD_SERVE_ROLES:
        raise ConfigError(f"--topo {topology!r} is disaggregated: serve it as one side, --pd-role prefill or "
                          f"--pd-role decode (got {role or 'none'}), with --pd-store ROOT shared by both servers")
    if not has_prefill and (role or store):
        raise ConfigError(f"--pd-role/--pd-store need a disaggregated topology PREFILL>DECODE (e.g. tp2>tp1), "
                          f"got {topology!r}")
    if has_prefill and not store:
        raise ConfigError(f"--pd-role {role} needs --pd-store ROOT (the KV store folder both servers share)")
